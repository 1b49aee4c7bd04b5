"""Mixtral (``MixtralForCausalLM``): softmax over all experts, top-k, renormalise — every layer.

The reference takes the softmax in float32 even for a float64 model, so we do
too.  With ``sliding_window`` set, every layer attends to the last
``sliding_window`` positions including its own (transformers keeps key ``j``
for query ``i`` when ``i - j < sliding_window``; PagedAttention's convention).
Published checkpoints keep the router at ``block_sparse_moe.gate`` and each
expert as ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts, softmax_topk
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-5
ROPE_THETA = 1e6  # MixtralConfig's default theta, for configs that give none


def mixtral_num_experts(config: dict) -> int:
    """Published checkpoints say ``num_local_experts``; ``num_experts`` is its alias."""
    return int(config.get("num_local_experts", config.get("num_experts", 0)) or 0)


def mixtral_rope(config: dict) -> tuple[float, dict]:
    given = "rope_theta" in config or "rope_theta" in (config.get("rope_parameters") or {})
    return rope_settings(config if given else {**config, "rope_theta": ROPE_THETA})


class MixtralMoeBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k = config["num_experts_per_tok"]
        num_experts = mixtral_num_experts(config)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = MoEExperts(num_experts, hidden, config["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate).float()
        weights, ids = softmax_topk(logits, self.top_k, renormalize=True)
        self.record(ids)
        return self.experts(x, weights.to(x.dtype), ids)


class MixtralAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
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


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MixtralAttention(config, rotary)
        self.block_sparse_moe = MixtralMoeBlock(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MixtralForCausalLM(MoEForCausalLM):
    architecture = "MixtralForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"hidden_act {act!r} is not supported (only silu)")
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = mixtral_num_experts(config)
        if self.num_experts <= 0:
            raise ModelError("Mixtral config has no num_local_experts")
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = list(range(config["num_hidden_layers"]))
        self.max_model_len = int(config.get("max_position_embeddings", 4096 * 32))
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        theta, scaling = mixtral_rope(config)
        self.rotary = RotaryEmbedding(
            head_dim, theta, scaling, max_position_embeddings=self.max_model_len
        )
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(
            MixtralDecoderLayer(config, self.rotary) for _ in range(config["num_hidden_layers"])
        )
        for i, layer in enumerate(self.layers):
            layer.block_sparse_moe.moe_index = i
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", RMS_EPS))
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False)
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
        wm.direct("model.norm.weight", "norm.weight")
        if not self.tie_word_embeddings:
            wm.direct("lm_head.weight", "lm_head.weight")
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = layer.self_attn
            starts = (0, attn.q_size, attn.q_size + attn.kv_size)
            sizes = (attn.q_size, attn.kv_size, attn.kv_size)
            for name, start, size in zip(
                ("q_proj", "k_proj", "v_proj"), starts, sizes, strict=True
            ):
                wm.rows(f"{src}self_attn.{name}.weight", f"{dst}self_attn.qkv.weight", start, size)
            wm.direct(f"{src}self_attn.o_proj.weight", f"{dst}self_attn.o_proj.weight")
            for name in ("input_layernorm", "post_attention_layernorm"):
                wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")
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
