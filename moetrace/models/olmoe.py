"""OLMoE (``OlmoeForCausalLM``): softmax → top-k routing in every layer.

Every decoder layer routes.  Attention normalises q and k over the *whole*
projection (one RMSNorm across all heads, not per head), then optionally
clamps q, k and v to ``±clip_qkv`` before rotary — both as the reference does,
because either one changes the hidden states the routers see.
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
from moetrace.models.config_fields import num_routed_experts
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-5  # OlmoeConfig's default, for configs that leave it out


def olmoe_block(config: dict) -> SoftmaxTopKMoEBlock:
    return SoftmaxTopKMoEBlock(
        num_routed_experts(config),
        config["hidden_size"],
        config["intermediate_size"],
        config["num_experts_per_tok"],
        renormalize=bool(config.get("norm_topk_prob", False)),
        logits_in_float32=True,  # the reference's softmax is float32 whatever the model dtype
    )


class OlmoeForCausalLM(DecoderLM):
    architecture = "OlmoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        require_silu(config)
        self.config = config
        hidden = config["hidden_size"]
        self.num_experts = num_routed_experts(config)
        if self.num_experts <= 0:
            raise ModelError("OLMoE config has no num_experts")
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = list(range(config["num_hidden_layers"]))
        self.max_model_len = int(config.get("max_position_embeddings", 4096))
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            head_dim_of(config), theta, scaling, max_position_embeddings=self.max_model_len
        )
        self._init_embedding(config)
        eps = config.get("rms_norm_eps", RMS_EPS)
        clip = config.get("clip_qkv")
        self.layers = nn.ModuleList(
            PreNormDecoderLayer(
                lambda: RMSNorm(hidden, eps),
                FusedQKVAttention(
                    config,
                    self.rotary,
                    bias=bool(config.get("attention_bias", False)),
                    qk_norm="full",
                    norm_eps=eps,
                    clip=None if clip is None else float(clip),
                ),
                olmoe_block(config),
            )
            for _ in range(config["num_hidden_layers"])
        )
        self._init_head(config, RMSNorm(hidden, eps))

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        map_norms(wm, layer, src, dst)
        wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
        map_experts(wm, layer.mlp.experts, f"{src}mlp.experts.", f"{dst}mlp.experts.")
