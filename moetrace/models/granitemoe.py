"""GraniteMoE (``GraniteMoeForCausalLM``): top-k on the router logits, softmax over the k.

Every layer routes.  Four scalar multipliers set it apart from Mixtral:
embeddings are multiplied by ``embedding_multiplier``, each sub-layer's output
by ``residual_multiplier`` before it joins the residual, attention scores by
``attention_multiplier`` (instead of ``head_dim ** -0.5``), and logits are
divided by ``logits_scaling``.  Checkpoints hold each layer's experts fused:
``block_sparse_moe.input_linear.weight [E, 2I, H]`` (gate rows, then up rows —
our ``w13`` as is), ``output_linear.weight [E, H, I]`` and the router at
``block_sparse_moe.router.layer.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.moe import MoEExperts, RoutingRule, topk_softmax, topk_softmax_weights
from moetrace.layers.norm import RMSNorm
from moetrace.layers.residual import add_norm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase
from moetrace.models.common import (
    DecoderLM,
    FusedQKVAttention,
    PreNormDecoderLayer,
    head_dim_of,
    map_fused_attention,
    map_norms,
    require_silu,
)
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-6


def _multiplier(config: dict, name: str) -> float:
    value = config.get(name)
    return 1.0 if value is None else float(value)


class GraniteMoeBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        num_experts = config["num_local_experts"]
        self.top_k = config["num_experts_per_tok"]
        self.router = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = MoEExperts(num_experts, hidden, config["intermediate_size"])
        self.routing_rule = RoutingRule("topk_softmax")

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_softmax(logits, self.top_k)

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return topk_softmax_weights(logits, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference takes the logits to float32 before top-k and softmax.
        weights, ids = self.route_and_record(F.linear(x, self.router), x.dtype, upcast=True)
        return self.experts(x, weights, ids)


class GraniteMoeDecoderLayer(PreNormDecoderLayer):
    """Each sub-layer's output is scaled by ``residual_multiplier`` before it joins the residual."""

    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", RMS_EPS)
        attn = FusedQKVAttention(
            config,
            rotary,
            bias=bool(config.get("attention_bias", False)),
            scale=_multiplier(config, "attention_multiplier"),
        )
        super().__init__(
            lambda: RMSNorm(hidden, eps), attn, GraniteMoeBlock(config), "block_sparse_moe"
        )
        self.residual_multiplier = _multiplier(config, "residual_multiplier")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_norm(self.input_layernorm, x, residual)
        attn = self.self_attn(h, cos, sin) * self.residual_multiplier
        h, residual = add_norm(self.post_attention_layernorm, attn, residual)
        return self.block_sparse_moe(h) * self.residual_multiplier, residual


class GraniteMoeForCausalLM(DecoderLM):
    architecture = "GraniteMoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        require_silu(config, "GraniteMoE")
        self.config = config
        hidden = config["hidden_size"]
        self.num_experts = int(config.get("num_local_experts") or 0)
        if self.num_experts <= 0:
            raise ModelError("GraniteMoE config has no num_local_experts")
        self.top_k = config["num_experts_per_tok"]
        num_layers = config["num_hidden_layers"]
        self.moe_layer_indices = list(range(num_layers))
        self.max_model_len = int(config.get("max_position_embeddings", 2048))
        self.embedding_multiplier = _multiplier(config, "embedding_multiplier")
        self.logits_scaling = _multiplier(config, "logits_scaling")
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim_of(config), theta, scaling)
        self._init_embedding(config)
        self.layers = nn.ModuleList(
            GraniteMoeDecoderLayer(config, self.rotary) for _ in range(num_layers)
        )
        self._init_head(config, RMSNorm(hidden, config.get("rms_norm_eps", RMS_EPS)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        map_norms(wm, layer, src, dst)
        moe_src, moe = f"{src}block_sparse_moe.", f"{dst}block_sparse_moe."
        wm.direct(f"{moe_src}router.layer.weight", f"{moe}router")
        wm.direct(f"{moe_src}input_linear.weight", f"{moe}experts.w13")
        wm.direct(f"{moe_src}output_linear.weight", f"{moe}experts.w2")
