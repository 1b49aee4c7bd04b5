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
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts, topk_softmax
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-6
QKV = ("q_proj", "k_proj", "v_proj")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference takes the logits to float32 before top-k and softmax.
        weights, ids = topk_softmax(F.linear(x, self.router).float(), self.top_k)
        self.record(ids)
        return self.experts(x, weights.to(x.dtype), ids)


class GraniteMoeAttention(nn.Module):
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
        scale = _multiplier(config, "attention_multiplier")
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(t, -1))


class GraniteMoeDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = GraniteMoeAttention(config, rotary)
        self.block_sparse_moe = GraniteMoeBlock(config)
        self.residual_multiplier = _multiplier(config, "residual_multiplier")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin) * self.residual_multiplier
        moe_out = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + moe_out * self.residual_multiplier


class GraniteMoeForCausalLM(MoEForCausalLM):
    architecture = "GraniteMoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"GraniteMoE hidden_act {act!r} is not supported (only silu)")
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = int(config.get("num_local_experts") or 0)
        if self.num_experts <= 0:
            raise ModelError("GraniteMoE config has no num_local_experts")
        self.top_k = config["num_experts_per_tok"]
        num_layers = config["num_hidden_layers"]
        self.moe_layer_indices = list(range(num_layers))
        self.max_model_len = int(config.get("max_position_embeddings", 2048))
        self.embedding_multiplier = _multiplier(config, "embedding_multiplier")
        self.logits_scaling = _multiplier(config, "logits_scaling")
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, theta, scaling)
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(
            GraniteMoeDecoderLayer(config, self.rotary) for _ in range(num_layers)
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
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling

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
            kinds = ("weight", "bias") if attn.qkv.bias is not None else ("weight",)
            for kind in kinds:
                for name, start, size in zip(QKV, starts, sizes, strict=True):
                    wm.rows(
                        f"{src}self_attn.{name}.{kind}", f"{dst}self_attn.qkv.{kind}", start, size
                    )
                wm.direct(f"{src}self_attn.o_proj.{kind}", f"{dst}self_attn.o_proj.{kind}")
            for name in ("input_layernorm", "post_attention_layernorm"):
                wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")
            moe_src, moe = f"{src}block_sparse_moe.", f"{dst}block_sparse_moe."
            wm.direct(f"{moe_src}router.layer.weight", f"{moe}router")
            wm.direct(f"{moe_src}input_linear.weight", f"{moe}experts.w13")
            wm.direct(f"{moe_src}output_linear.weight", f"{moe}experts.w2")
        return wm

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.weights.load(name, tensor)

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets)
