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
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts, softmax_topk
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.qwen3_moe import DenseMLP, qwen3_moe_layer_indices
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-6


def qwen2_moe_num_experts(config: dict) -> int:
    return int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)


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


class Qwen2MoeBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k = config["num_experts_per_tok"]
        self.renormalize = bool(config.get("norm_topk_prob", False))
        num_experts = qwen2_moe_num_experts(config)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = MoEExperts(num_experts, hidden, config["moe_intermediate_size"])
        self.shared_expert = DenseMLP(hidden, config["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate).float()  # the reference's softmax is always float32
        weights, ids = softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        self.record(ids)
        routed = self.experts(x, weights.to(x.dtype), ids)
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return routed + shared


class Qwen2MoeAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Published Qwen1.5-MoE configs predate the qkv_bias key and all have the biases.
        bias = bool(config.get("qkv_bias", True))
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=window,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(t, -1))


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(
        self, config: dict, is_moe: bool, window: int | None, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Qwen2MoeAttention(config, rotary, window)
        self.mlp: nn.Module = (
            Qwen2MoeBlock(config) if is_moe else DenseMLP(hidden, config["intermediate_size"])
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2MoeForCausalLM(MoEForCausalLM):
    architecture = "Qwen2MoeForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"hidden_act {act!r} is not supported (only silu)")
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = qwen2_moe_num_experts(config)
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = qwen3_moe_layer_indices(config)
        if not self.moe_layer_indices:
            raise ModelError("Qwen2-MoE config has no MoE layers (num_experts, mlp_only_layers)")
        self.max_model_len = int(config.get("max_position_embeddings", 32768))
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            head_dim, theta, scaling, max_position_embeddings=self.max_model_len
        )
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        moe = set(self.moe_layer_indices)
        windows = qwen2_moe_sliding_windows(config)
        self.layers = nn.ModuleList(
            Qwen2MoeDecoderLayer(config, i in moe, windows[i], self.rotary)
            for i in range(config["num_hidden_layers"])
        )
        for n, i in enumerate(self.moe_layer_indices):
            self.layers[i].mlp.moe_index = n
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
        moe = set(self.moe_layer_indices)
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
            for name in ("input_layernorm", "post_attention_layernorm"):
                wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")
            if i in moe:
                mlp = layer.mlp
                inter = mlp.experts.intermediate
                wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
                wm.direct(f"{src}mlp.shared_expert_gate.weight", f"{dst}mlp.shared_expert_gate")
                _dense(
                    wm, f"{src}mlp.shared_expert.", f"{dst}mlp.shared_expert.", mlp.shared_expert
                )
                for e in range(self.num_experts):
                    ex = f"{src}mlp.experts.{e}."
                    wm.rows(f"{ex}gate_proj.weight", f"{dst}mlp.experts.w13", 0, inter, index=e)
                    wm.rows(f"{ex}up_proj.weight", f"{dst}mlp.experts.w13", inter, inter, index=e)
                    wm.direct(f"{ex}down_proj.weight", f"{dst}mlp.experts.w2", index=e)
            else:
                _dense(wm, f"{src}mlp.", f"{dst}mlp.", layer.mlp)
        return wm

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.weights.load(name, tensor)

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets)


def _dense(wm: WeightMap, src: str, dst: str, mlp: DenseMLP) -> None:
    """A checkpoint's gate_proj/up_proj/down_proj onto a fused DenseMLP."""
    inter = mlp.down.shape[1]
    wm.rows(f"{src}gate_proj.weight", f"{dst}gate_up", 0, inter)
    wm.rows(f"{src}up_proj.weight", f"{dst}gate_up", inter, inter)
    wm.direct(f"{src}down_proj.weight", f"{dst}down")
