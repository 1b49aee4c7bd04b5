"""PhiMoE (``PhimoeForCausalLM``): sparsemixer top-2 routing — every layer.

The router's eval-mode sparsemixer picks the largest logit, then the largest
of the rest; each pick's weight is its softmax over the logits that lie within
a relative ``2 * router_jitter_noise`` of that pick's logit (the others masked
out), so the weights depend on ``router_jitter_noise`` even in eval mode.
It always routes two experts.  Norms are LayerNorm with bias (eps from
``rms_norm_eps``); attention and ``lm_head`` may carry biases.  Checkpoints
keep the router at ``block_sparse_moe.gate`` and each expert as ``w1`` (gate),
``w3`` (up), ``w2`` (down).

Rope ``longrope`` (published Phi-3.5-MoE) is supported up to
``original_max_position_embeddings``: there the reference uses the short
factors and ``short_mscale`` for every position, which we reproduce; past it,
its scale depends on the length of the whole forward call (a batching
artefact), so the context is capped there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.moe import MoEExperts
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase
from moetrace.models.common import (
    DecoderLM,
    FusedQKVAttention,
    PreNormDecoderLayer,
    head_dim_of,
    map_experts,
    map_fused_attention,
    map_norms,
    require_silu,
)
from moetrace.models.weights import WeightMap

NORM_EPS = 1e-5
ROPE_THETA = 1e6  # PhimoeConfig's default theta, for configs that give none


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of PhiMoE's sparsemixer in eval mode, op for op as the reference."""
    first = logits.argmax(dim=-1, keepdim=True)
    second = torch.scatter(logits, -1, first, float("-inf")).argmax(dim=-1, keepdim=True)
    ids = torch.cat((first, second), dim=-1)
    return sparsemixer_weights(logits, ids, jitter_eps), ids


def sparsemixer_weights(logits: torch.Tensor, ids: torch.Tensor, jitter_eps: float) -> torch.Tensor:
    """The sparsemixer's weights for a (first, second) pair: each pick's softmax over the logits
    within a relative ``2 * jitter_eps`` of its own logit, the second pick's with the first
    masked out.  For the pair the sparsemixer picks, its own weights."""
    first, second = ids[:, :1], ids[:, 1:2]
    top = logits.gather(-1, first)
    factor = logits.abs().clamp(min=top)
    masked = logits.masked_fill((top - logits) / factor > 2 * jitter_eps, float("-inf"))
    weight_first = torch.softmax(masked, dim=-1).gather(-1, first)
    rest = torch.scatter(logits, -1, first, float("-inf"))
    top = rest.gather(-1, second)
    factor = logits.abs().clamp(min=top)  # the reference scales by the unmasked logits here
    masked = rest.masked_fill((top - logits) / factor > 2 * jitter_eps, float("-inf"))
    weight_second = torch.softmax(masked, dim=-1).gather(-1, second)
    return torch.cat((weight_first, weight_second), dim=-1)


class PhimoeRotary(RotaryEmbedding):
    """Default rope, or longrope's short factors scaled by ``short_mscale``."""

    def __init__(self, config: dict, head_dim: int) -> None:
        given = "rope_theta" in config or "rope_theta" in (config.get("rope_parameters") or {})
        theta, scaling = rope_settings(config if given else {**config, "rope_theta": ROPE_THETA})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "longrope":
            super().__init__(head_dim, theta, scaling)
            return
        super().__init__(head_dim, theta)
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        if short.numel() != head_dim // 2:
            raise ModelError(
                f"longrope short_factor has {short.numel()} values, need {head_dim // 2}"
            )
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq = 1.0 / (short * theta**exponents)
        self.attention_scaling = float(scaling["short_mscale"])


def longrope_context(config: dict) -> int | None:
    """Where the reference's longrope stops being a per-token function (None: not longrope)."""
    _, scaling = rope_settings(config)
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return None
    return int(
        config.get("original_max_position_embeddings")
        or scaling["original_max_position_embeddings"]
    )


class PhimoeBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        num_experts = config["num_local_experts"]
        self.jitter_eps = float(config.get("router_jitter_noise", 0.01))
        self.gate = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = MoEExperts(num_experts, hidden, config["intermediate_size"])

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sparsemixer_top2(logits, self.jitter_eps)

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return sparsemixer_weights(logits, ids, self.jitter_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(F.linear(x, self.gate))
        self.record(ids, weights)
        return self.experts(x, weights, ids)


class PhimoeForCausalLM(DecoderLM):
    architecture = "PhimoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        require_silu(config, "PhiMoE")
        top_k = config.get("num_experts_per_tok", 2)
        if top_k != 2:
            raise ModelError(
                f"PhiMoE's sparsemixer routes exactly 2 experts; config says num_experts_per_tok={top_k}"
            )
        self.config = config
        hidden = config["hidden_size"]
        self.num_experts = int(config.get("num_local_experts") or 0)
        if self.num_experts < 2:
            raise ModelError("PhiMoE config needs num_local_experts >= 2")
        self.top_k = 2
        num_layers = config["num_hidden_layers"]
        self.moe_layer_indices = list(range(num_layers))
        self.max_model_len = int(config.get("max_position_embeddings", 4096 * 32))
        self.max_model_len = min(self.max_model_len, longrope_context(config) or self.max_model_len)
        self.rotary = PhimoeRotary(config, head_dim_of(config))
        self._init_embedding(config)
        eps = config.get("rms_norm_eps", NORM_EPS)
        bias = bool(config.get("attention_bias", False))
        window = config.get("sliding_window") or None
        self.layers = nn.ModuleList(
            PreNormDecoderLayer(
                lambda: nn.LayerNorm(hidden, eps=eps),
                FusedQKVAttention(config, self.rotary, bias=bias, window=window),
                PhimoeBlock(config),
                "block_sparse_moe",
            )
            for _ in range(num_layers)
        )
        self.lm_head_bias = bool(config.get("lm_head_bias", False))
        self._init_head(config, nn.LayerNorm(hidden, eps=eps), lm_head_bias=self.lm_head_bias)

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        map_norms(wm, layer, src, dst)
        moe_src, moe = f"{src}block_sparse_moe.", f"{dst}block_sparse_moe."
        wm.direct(f"{moe_src}gate.weight", f"{moe}gate")
        experts = layer.block_sparse_moe.experts
        map_experts(wm, experts, f"{moe_src}experts.", f"{moe}experts.", ("w1", "w3", "w2"))
