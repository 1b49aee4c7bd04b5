"""Qwen2-MoE (``Qwen2MoeForCausalLM``): softmax → top-k routed experts plus a gated shared expert.

The MoE block adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` to
the routed output; only the routed ids are recorded.  Which layers route is
Qwen3-MoE's rule (``mlp_only_layers``, ``decoder_sparse_step``).  Attention
has q/k/v biases and, with ``use_sliding_window``, a sliding window on the
layers the reference marks ``sliding_attention``: ``layer_types`` when the
config lists them, else transformers' default (even layers below
``max_window_layers``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.norm import RMSNorm
from moetrace.layers.residual import SubLayerOutput, plus
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
    require_silu,
)
from moetrace.models.config_fields import num_routed_experts
from moetrace.models.qwen3_moe import qwen3_moe_layer_indices
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-6


def qwen2_moe_sliding_windows(config: dict) -> list[int | None]:
    """Per decoder layer: its attention window, or None for full attention."""
    layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or not window:
        return [None] * layers
    types = config.get("layer_types")
    if types is None:
        max_window_layers = config.get("max_window_layers", 28)
        types = [
            "sliding_attention" if i % 2 == 0 and i < max_window_layers else "full_attention"
            for i in range(layers)
        ]
    return [int(window) if t == "sliding_attention" else None for t in types]


class Qwen2MoeBlock(SoftmaxTopKMoEBlock):
    """The softmax top-k block plus a shared expert behind a sigmoid gate."""

    def __init__(self, config: dict) -> None:
        hidden = config["hidden_size"]
        super().__init__(
            num_routed_experts(config),
            hidden,
            config["moe_intermediate_size"],
            config["num_experts_per_tok"],
            renormalize=bool(config.get("norm_topk_prob", False)),
            logits_in_float32=True,  # the reference's softmax is always float32
        )
        self.shared_expert = DenseMLP(hidden, config["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor, *, keep_rows: bool = False) -> SubLayerOutput:
        routed = super().forward(x, keep_rows=keep_rows)
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return plus(routed, shared)


class Qwen2MoeForCausalLM(DecoderLM):
    architecture = "Qwen2MoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        require_silu(config)
        self.config = config
        hidden = config["hidden_size"]
        self.num_experts = num_routed_experts(config)
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = qwen3_moe_layer_indices(config)
        if not self.moe_layer_indices:
            raise ModelError("Qwen2-MoE config has no MoE layers (num_experts, mlp_only_layers)")
        self.max_model_len = int(config.get("max_position_embeddings", 32768))
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            head_dim_of(config), theta, scaling, max_position_embeddings=self.max_model_len
        )
        self._init_embedding(config)
        eps = config.get("rms_norm_eps", RMS_EPS)
        # Published Qwen1.5-MoE configs predate the qkv_bias key and all have the biases.
        bias = bool(config.get("qkv_bias", True))
        moe = set(self.moe_layer_indices)
        windows = qwen2_moe_sliding_windows(config)
        self.layers = nn.ModuleList(
            PreNormDecoderLayer(
                lambda: RMSNorm(hidden, eps),
                FusedQKVAttention(config, self.rotary, bias=bias, o_bias=False, window=windows[i]),
                Qwen2MoeBlock(config)
                if i in moe
                else DenseMLP(hidden, config["intermediate_size"]),
            )
            for i in range(config["num_hidden_layers"])
        )
        self._init_head(config, RMSNorm(hidden, eps))

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        map_norms(wm, layer, src, dst)
        mlp = layer.mlp
        if isinstance(mlp, Qwen2MoeBlock):
            wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
            wm.direct(f"{src}mlp.shared_expert_gate.weight", f"{dst}mlp.shared_expert_gate")
            map_dense(wm, mlp.shared_expert, f"{src}mlp.shared_expert.", f"{dst}mlp.shared_expert.")
            map_experts(wm, mlp.experts, f"{src}mlp.experts.", f"{dst}mlp.experts.")
        else:
            map_dense(wm, mlp, f"{src}mlp.", f"{dst}mlp.")
