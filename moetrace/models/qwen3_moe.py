"""Qwen3-MoE (``Qwen3MoeForCausalLM``): softmax → top-k routing, optional renormalisation.

Layer ``i`` routes unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; those layers run a dense MLP and get
no routing rows.  Attention has per-head RMSNorm on q and k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts, softmax_topk
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.weights import WeightMap


def qwen3_moe_layer_indices(config: dict) -> list[int]:
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    num_experts = _num_experts(config)
    return [
        i
        for i in range(config["num_hidden_layers"])
        if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
    ]


def _num_experts(config: dict) -> int:
    return int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(hidden, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class Qwen3MoeBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k = config["num_experts_per_tok"]
        self.renormalize = bool(config.get("norm_topk_prob", False))
        self.gate = nn.Parameter(torch.empty(_num_experts(config), hidden))
        self.experts = MoEExperts(_num_experts(config), hidden, config["moe_intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate)
        weights, ids = softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        self.record(ids)
        return self.experts(x, weights.to(x.dtype), ids)


class Qwen3MoeAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.qkv = nn.Linear(
            hidden, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.rotary = rotary
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=window,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
            ],
            dim=-1,
        )
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(t, -1))


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: dict, index: int, is_moe: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Qwen3MoeAttention(config, rotary)
        self.mlp: nn.Module = (
            Qwen3MoeBlock(config) if is_moe else DenseMLP(hidden, config["intermediate_size"])
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    architecture = "Qwen3MoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = _num_experts(config)
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = qwen3_moe_layer_indices(config)
        self.max_model_len = int(config.get("max_position_embeddings", 32768))
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, theta, scaling)
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        moe = set(self.moe_layer_indices)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, i, i in moe, self.rotary)
            for i in range(config["num_hidden_layers"])
        )
        for n, i in enumerate(self.moe_layer_indices):
            self.layers[i].mlp.moe_index = n
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
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
        moe = set(self.moe_layer_indices)
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = layer.self_attn
            q_rows = attn.num_heads * attn.head_dim
            kv_rows = attn.num_kv_heads * attn.head_dim
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                start = (0, q_rows, q_rows + kv_rows)[j]
                size = (q_rows, kv_rows, kv_rows)[j]
                wm.rows(f"{src}self_attn.{name}.weight", f"{dst}self_attn.qkv.weight", start, size)
                if attn.qkv.bias is not None:
                    wm.rows(f"{src}self_attn.{name}.bias", f"{dst}self_attn.qkv.bias", start, size)
            wm.direct(f"{src}self_attn.o_proj.weight", f"{dst}self_attn.o_proj.weight")
            if attn.o_proj.bias is not None:
                wm.direct(f"{src}self_attn.o_proj.bias", f"{dst}self_attn.o_proj.bias")
            wm.direct(f"{src}self_attn.q_norm.weight", f"{dst}self_attn.q_norm.weight")
            wm.direct(f"{src}self_attn.k_norm.weight", f"{dst}self_attn.k_norm.weight")
            wm.direct(f"{src}input_layernorm.weight", f"{dst}input_layernorm.weight")
            wm.direct(
                f"{src}post_attention_layernorm.weight", f"{dst}post_attention_layernorm.weight"
            )
            if i in moe:
                mlp = layer.mlp
                inter = mlp.experts.intermediate
                wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
                for e in range(mlp.experts.num_experts):
                    ex = f"{src}mlp.experts.{e}."
                    wm.rows(f"{ex}gate_proj.weight", f"{dst}mlp.experts.w13", 0, inter, index=e)
                    wm.rows(f"{ex}up_proj.weight", f"{dst}mlp.experts.w13", inter, inter, index=e)
                    wm.direct(f"{ex}down_proj.weight", f"{dst}mlp.experts.w2", index=e)
            else:
                inter = layer.mlp.down.shape[1]
                wm.rows(f"{src}mlp.gate_proj.weight", f"{dst}mlp.gate_up", 0, inter)
                wm.rows(f"{src}mlp.up_proj.weight", f"{dst}mlp.gate_up", inter, inter)
                wm.direct(f"{src}mlp.down_proj.weight", f"{dst}mlp.down")
        return wm

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.weights.load(name, tensor)

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets)
