"""Mixtral (``MixtralForCausalLM``): softmax over all experts, top-k, renormalise — every layer.

The reference takes the softmax in float32 even for a float64 model, so we do
too.  With ``sliding_window`` set, every layer attends to the last
``sliding_window`` positions including its own (transformers keeps key ``j``
for query ``i`` when ``i - j < sliding_window``; PagedAttention's convention).
Published checkpoints keep the router at ``block_sparse_moe.gate`` and each
expert as ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.common import (
    DecoderLM,
    FusedQKVAttention,
    PreNormDecoderLayer,
    SoftmaxTopKMoEBlock,
    head_dim_of,
    map_experts,
    map_fused_attention,
    map_norms,
    require_silu,
)
from moetrace.models.config_fields import MIXTRAL_EXPERT_KEYS, num_routed_experts
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-5
ROPE_THETA = 1e6  # MixtralConfig's default theta, for configs that give none


def mixtral_rope(config: dict) -> tuple[float, dict]:
    given = "rope_theta" in config or "rope_theta" in (config.get("rope_parameters") or {})
    return rope_settings(config if given else {**config, "rope_theta": ROPE_THETA})


def mixtral_block(config: dict) -> SoftmaxTopKMoEBlock:
    return SoftmaxTopKMoEBlock(
        num_routed_experts(config, MIXTRAL_EXPERT_KEYS),
        config["hidden_size"],
        config["intermediate_size"],
        config["num_experts_per_tok"],
        renormalize=True,  # top-k then renormalise, always
        logits_in_float32=True,
    )


class MixtralForCausalLM(DecoderLM):
    architecture = "MixtralForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        require_silu(config)
        self.config = config
        hidden = config["hidden_size"]
        self.num_experts = num_routed_experts(config, MIXTRAL_EXPERT_KEYS)
        if self.num_experts <= 0:
            raise ModelError("Mixtral config has no num_local_experts")
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = list(range(config["num_hidden_layers"]))
        self.max_model_len = int(config.get("max_position_embeddings", 4096 * 32))
        theta, scaling = mixtral_rope(config)
        self.rotary = RotaryEmbedding(
            head_dim_of(config), theta, scaling, max_position_embeddings=self.max_model_len
        )
        self._init_embedding(config)
        eps = config.get("rms_norm_eps", RMS_EPS)
        window = config.get("sliding_window") or None
        self.layers = nn.ModuleList(
            PreNormDecoderLayer(
                lambda: RMSNorm(hidden, eps),
                FusedQKVAttention(config, self.rotary, window=window),
                mixtral_block(config),
                "block_sparse_moe",
            )
            for _ in range(config["num_hidden_layers"])
        )
        self._init_head(config, RMSNorm(hidden, eps))

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        map_norms(wm, layer, src, dst)
        moe_src, moe = f"{src}block_sparse_moe.", f"{dst}block_sparse_moe."
        wm.direct(f"{moe_src}gate.weight", f"{moe}gate")
        experts = layer.block_sparse_moe.experts
        map_experts(wm, experts, f"{moe_src}experts.", f"{moe}experts.", ("w1", "w3", "w2"))
