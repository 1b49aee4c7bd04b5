"""OLMoE (``OlmoeForCausalLM``): softmax → top-k routing in every layer.

Every decoder layer routes.  Attention normalises q and k over the *whole*
projection (one RMSNorm across all heads, not per head), then optionally
clamps q, k and v to ``±clip_qkv`` before rotary — both as the reference does,
because either one changes the hidden states the routers see.
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

RMS_EPS = 1e-5  # OlmoeConfig's default, for configs that leave it out


def olmoe_num_experts(config: dict) -> int:
    """Published checkpoints say ``num_experts``; ``num_local_experts`` is its alias."""
    return int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)


class OlmoeMoeBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k = config["num_experts_per_tok"]
        self.renormalize = bool(config.get("norm_topk_prob", False))
        num_experts = olmoe_num_experts(config)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = MoEExperts(num_experts, hidden, config["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference's softmax is float32 whatever the model dtype (float64 included).
        logits = F.linear(x, self.gate).float()
        weights, ids = softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        self.record(ids)
        return self.experts(x, weights.to(x.dtype), ids)


class OlmoeAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias)
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.q_norm = RMSNorm(self.q_size, eps)
        self.k_norm = RMSNorm(self.kv_size, eps)
        clip = config.get("clip_qkv")
        self.clip = None if clip is None else float(clip)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = RotaryEmbedding.apply(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(t, -1))


class OlmoeDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = OlmoeAttention(config, rotary)
        self.mlp = OlmoeMoeBlock(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class OlmoeForCausalLM(MoEForCausalLM):
    architecture = "OlmoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"hidden_act {act!r} is not supported (only silu)")
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = olmoe_num_experts(config)
        if self.num_experts <= 0:
            raise ModelError("OLMoE config has no num_experts")
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = list(range(config["num_hidden_layers"]))
        self.max_model_len = int(config.get("max_position_embeddings", 4096))
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            head_dim, theta, scaling, max_position_embeddings=self.max_model_len
        )
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(
            OlmoeDecoderLayer(config, self.rotary) for _ in range(config["num_hidden_layers"])
        )
        for i, layer in enumerate(self.layers):
            layer.mlp.moe_index = i
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
                if attn.qkv.bias is not None:
                    wm.rows(f"{src}self_attn.{name}.bias", f"{dst}self_attn.qkv.bias", start, size)
            wm.direct(f"{src}self_attn.o_proj.weight", f"{dst}self_attn.o_proj.weight")
            if attn.o_proj.bias is not None:
                wm.direct(f"{src}self_attn.o_proj.bias", f"{dst}self_attn.o_proj.bias")
            for name in ("self_attn.q_norm", "self_attn.k_norm"):
                wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")
            for name in ("input_layernorm", "post_attention_layernorm"):
                wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")
            inter = layer.mlp.experts.intermediate
            wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
            for e in range(self.num_experts):
                ex = f"{src}mlp.experts.{e}."
                wm.rows(f"{ex}gate_proj.weight", f"{dst}mlp.experts.w13", 0, inter, index=e)
                wm.rows(f"{ex}up_proj.weight", f"{dst}mlp.experts.w13", inter, inter, index=e)
                wm.direct(f"{ex}down_proj.weight", f"{dst}mlp.experts.w2", index=e)
        return wm

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.weights.load(name, tensor)

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets)
