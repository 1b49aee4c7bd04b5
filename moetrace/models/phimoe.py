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
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.weights import WeightMap

NORM_EPS = 1e-5
ROPE_THETA = 1e6  # PhimoeConfig's default theta, for configs that give none
QKV = ("q_proj", "k_proj", "v_proj")


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of PhiMoE's sparsemixer in eval mode, op for op as the reference."""
    top, first = logits.max(dim=-1, keepdim=True)
    factor = logits.abs().clamp(min=top)
    masked = logits.masked_fill((top - logits) / factor > 2 * jitter_eps, float("-inf"))
    weight_first = torch.softmax(masked, dim=-1).gather(-1, first)
    rest = torch.scatter(logits, -1, first, float("-inf"))
    top, second = rest.max(dim=-1, keepdim=True)
    factor = logits.abs().clamp(min=top)  # the reference scales by the unmasked logits here
    masked = rest.masked_fill((top - logits) / factor > 2 * jitter_eps, float("-inf"))
    weight_second = torch.softmax(masked, dim=-1).gather(-1, second)
    return torch.cat((weight_first, weight_second), dim=-1), torch.cat((first, second), dim=-1)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer_top2(F.linear(x, self.gate), self.jitter_eps)
        self.record(ids)
        return self.experts(x, weights, ids)


class PhimoeAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(config.get("attention_bias", False))
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=config.get("sliding_window") or None,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(t, -1))


class PhimoeDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", NORM_EPS)
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = PhimoeAttention(config, rotary)
        self.block_sparse_moe = PhimoeBlock(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class PhimoeForCausalLM(MoEForCausalLM):
    architecture = "PhimoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"PhiMoE hidden_act {act!r} is not supported (only silu)")
        top_k = config.get("num_experts_per_tok", 2)
        if top_k != 2:
            raise ModelError(
                f"PhiMoE's sparsemixer routes exactly 2 experts; config says num_experts_per_tok={top_k}"
            )
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = int(config.get("num_local_experts") or 0)
        if self.num_experts < 2:
            raise ModelError("PhiMoE config needs num_local_experts >= 2")
        self.top_k = 2
        num_layers = config["num_hidden_layers"]
        self.moe_layer_indices = list(range(num_layers))
        self.max_model_len = int(config.get("max_position_embeddings", 4096 * 32))
        self.max_model_len = min(self.max_model_len, longrope_context(config) or self.max_model_len)
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        self.rotary = PhimoeRotary(config, head_dim)
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(
            PhimoeDecoderLayer(config, self.rotary) for _ in range(num_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.block_sparse_moe.moe_index = i
        self.norm = nn.LayerNorm(hidden, eps=config.get("rms_norm_eps", NORM_EPS))
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head_bias = bool(config.get("lm_head_bias", False))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=self.lm_head_bias)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.weights = self._weight_map()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---------------------------------------------------------------- weights
    def _weight_map(self) -> WeightMap:
        wm = WeightMap(self)
        wm.direct("model.embed_tokens.weight", "embed_tokens.weight")
        for kind in ("weight", "bias"):
            wm.direct(f"model.norm.{kind}", f"norm.{kind}")
        if not self.tie_word_embeddings:
            wm.direct("lm_head.weight", "lm_head.weight")
        if self.lm_head_bias:
            wm.direct("lm_head.bias", "lm_head.bias")
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = layer.self_attn
            starts = (0, attn.q_size, attn.q_size + attn.kv_size)
            sizes = (attn.q_size, attn.kv_size, attn.kv_size)
            kinds = ("weight", "bias") if attn.qkv.bias is not None else ("weight",)
            for kind in kinds:
                for name, start, size in zip(QKV, starts, sizes, strict=True):
                    wm.rows(
                        f"{src}self_attn.{name}.{kind}", f"{dst}self_attn.qkv.{kind}", start, size
                    )
                wm.direct(f"{src}self_attn.o_proj.{kind}", f"{dst}self_attn.o_proj.{kind}")
            for name in ("input_layernorm", "post_attention_layernorm"):
                for kind in ("weight", "bias"):
                    wm.direct(f"{src}{name}.{kind}", f"{dst}{name}.{kind}")
            moe, inter = f"{dst}block_sparse_moe.", layer.block_sparse_moe.experts.intermediate
            wm.direct(f"{src}block_sparse_moe.gate.weight", f"{moe}gate")
            for e in range(self.num_experts):
                ex = f"{src}block_sparse_moe.experts.{e}."
                wm.rows(f"{ex}w1.weight", f"{moe}experts.w13", 0, inter, index=e)
                wm.rows(f"{ex}w3.weight", f"{moe}experts.w13", inter, inter, index=e)
                wm.direct(f"{ex}w2.weight", f"{moe}experts.w2", index=e)
        return wm

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.weights.load(name, tensor)

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets)
