"""Qwen3-MoE (``Qwen3MoeForCausalLM``): softmax → top-k routing, optional renormalisation.

Layer ``i`` routes unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; those layers run a dense MLP and get
no routing rows.  Attention has per-head RMSNorm on q and k.
"""

from __future__ import annotations

from torch import nn

from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.common import (
    DecoderLM,
    DenseMLP,
    FusedQKVAttention,
    PreNormDecoderLayer,
    SoftmaxTopKMoEBlock,
    head_dim_of,
    map_dense,
    map_experts,
    map_fused_attention,
    map_norms,
)
from moetrace.models.config_fields import num_routed_experts
from moetrace.models.weights import WeightMap


def qwen3_moe_layer_indices(config: dict) -> list[int]:
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    num_experts = num_routed_experts(config)
    return [
        i
        for i in range(config["num_hidden_layers"])
        if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
    ]


def qwen3_moe_block(config: dict) -> SoftmaxTopKMoEBlock:
    return SoftmaxTopKMoEBlock(
        num_routed_experts(config),
        config["hidden_size"],
        config["moe_intermediate_size"],
        config["num_experts_per_tok"],
        renormalize=bool(config.get("norm_topk_prob", False)),
        logits_in_float32=False,  # the reference's softmax keeps float64 logits
    )


class Qwen3MoeForCausalLM(DecoderLM):
    architecture = "Qwen3MoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        hidden = config["hidden_size"]
        self.num_experts = num_routed_experts(config)
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = qwen3_moe_layer_indices(config)
        self.max_model_len = int(config.get("max_position_embeddings", 32768))
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim_of(config), theta, scaling)
        self._init_embedding(config)
        eps = config.get("rms_norm_eps", 1e-6)
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        moe = set(self.moe_layer_indices)
        self.layers = nn.ModuleList(
            PreNormDecoderLayer(
                lambda: RMSNorm(hidden, eps),
                FusedQKVAttention(
                    config,
                    self.rotary,
                    bias=bool(config.get("attention_bias", False)),
                    qk_norm="head",
                    norm_eps=eps,
                    window=window,
                ),
                qwen3_moe_block(config)
                if i in moe
                else DenseMLP(hidden, config["intermediate_size"]),
            )
            for i in range(config["num_hidden_layers"])
        )
        self._init_head(config, RMSNorm(hidden, eps))

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        map_norms(wm, layer, src, dst)
        if isinstance(layer.mlp, SoftmaxTopKMoEBlock):
            wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
            map_experts(wm, layer.mlp.experts, f"{src}mlp.experts.", f"{dst}mlp.experts.")
        else:
            map_dense(wm, layer.mlp, f"{src}mlp.", f"{dst}mlp.")
