"""Pieces the model families share: the causal-LM shell, fused-qkv attention, weight-map rows.

Families differ in routing, not in plumbing; keeping the plumbing here means
a fix to the shell or to the q/k/v mapping reaches every family at once.
Module and parameter names (``self_attn.qkv``, ``o_proj``, ``layers.{i}``, …)
are the ones ``distributed/sharding.py`` and the checkpoints rely on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.forward_context import get_attention_metadata
from moetrace.layers import residual
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts, RoutingRule, softmax_topk, softmax_weights
from moetrace.layers.norm import RMSNorm
from moetrace.layers.residual import SubLayerOutput, add_norm
from moetrace.layers.rotary import RotaryEmbedding
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.weights import WeightMap

QKV = ("q_proj", "k_proj", "v_proj")


def head_dim_of(config: dict) -> int:
    """``head_dim`` when the config gives one, else hidden size over heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def require_silu(config: dict, family: str = "") -> None:
    """Refuse activations the experts do not implement (``family`` prefixes the message)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        prefix = f"{family} " if family else ""
        raise ModelError(f"{prefix}hidden_act {act!r} is not supported (only silu)")


def _kinds(module: nn.Module) -> tuple[str, ...]:
    """Which of ``weight``/``bias`` the module holds (RMSNorm has no bias, LayerNorm has)."""
    return tuple(k for k in ("weight", "bias") if getattr(module, k, None) is not None)


class DenseMLP(nn.Module):
    """SwiGLU MLP of the non-routed layers; gate and up fused into one matrix."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(hidden, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class SoftmaxTopKMoEBlock(MoEBlockBase):
    """Gate, softmax over every expert, top-k (renormalised or not), routed experts.

    OLMoE, Mixtral, Qwen2-MoE and Qwen3-MoE route this way.  They differ in one
    detail of their references: OLMoE, Mixtral and Qwen2-MoE take the logits to
    float32 even in a float64 model (``logits_in_float32``); Qwen3-MoE keeps
    float64.  In 16-bit models both are the same float32 softmax.
    """

    can_keep_rows = True  # its output is the experts': the residual add may sum their rows

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        top_k: int,
        *,
        renormalize: bool,
        logits_in_float32: bool,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.logits_in_float32 = logits_in_float32
        self.gate = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = MoEExperts(num_experts, hidden, intermediate)
        self.routing_rule = RoutingRule("softmax_topk", renormalize)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k, renormalize=self.renormalize)

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return softmax_weights(logits, ids, renormalize=self.renormalize)

    def forward(self, x: torch.Tensor, *, keep_rows: bool = False) -> SubLayerOutput:
        logits = F.linear(x, self.gate)
        weights, ids = self.route_and_record(logits, x.dtype, upcast=self.logits_in_float32)
        return self.experts(x, weights, ids, keep_rows=keep_rows)


class FusedQKVAttention(nn.Module):
    """Rotary attention with q, k and v in one projection; options cover the families' variants.

    ``qk_norm``: None, ``"head"`` (RMSNorm per head, Qwen3) or ``"full"`` (RMSNorm
    over the whole projection, OLMoE).  ``clip`` clamps q, k and v after the
    norm, before rotary.  ``scale`` defaults to ``head_dim ** -0.5``.
    """

    def __init__(
        self,
        config: dict,
        rotary: RotaryEmbedding,
        *,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        clip: float | None = None,
        scale: float | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias if o_bias is None else o_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, norm_eps)
            self.k_norm = RMSNorm(self.head_dim, norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, norm_eps)
            self.k_norm = RMSNorm(self.kv_size, norm_eps)
        elif qk_norm is not None:
            raise ValueError(f"unknown qk_norm {qk_norm!r}")
        self.clip = clip
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            sliding_window=window,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        if self._fused_rope(qkv):
            from moetrace.kernels.triton_qkv import qkv_rope_store  # Triton only where it runs

            norms = {}
            if self.qk_norm is not None:
                norms = {
                    "norm": self.qk_norm,
                    "q_weight": self.q_norm.weight,
                    "k_weight": self.k_norm.weight,
                    "q_eps": self.q_norm.eps,
                    "k_eps": self.k_norm.eps,
                }
            meta = get_attention_metadata()
            q = qkv_rope_store(
                qkv, self.num_heads, self.num_kv_heads, cos, sin,
                self.attn.k_cache, self.attn.v_cache, meta.slot_mapping, **norms,
            )  # fmt: skip
            return self.o_proj(self.attn.attend(q).reshape(t, -1))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.attn.use_triton and q.dtype == torch.bfloat16:
            from moetrace.kernels.triton_norm import rotary  # Triton only where kernels run

            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        else:
            q = RotaryEmbedding.apply(q, cos, sin)
            k = RotaryEmbedding.apply(k, cos, sin)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(t, -1))

    def _fused_rope(self, qkv: torch.Tensor) -> bool:
        """Whether one kernel does the q/k norms, rotary and the KV store
        (``kernels/triton_qkv.py``): bit-identical to the ops it replaces, which it
        rounds as, so only where those are its kind (16-bit, the norms on their
        kernel, no clamp, aligned rows; a norm over the whole projection with as many q
        as kv heads)."""
        if not (residual.FUSED_NORMS and self.attn.use_triton):
            return False
        if qkv.dtype not in (torch.bfloat16, torch.float16):
            return False
        if self.clip is not None or self.head_dim % 2 or not residual.sixteen_byte_rows(qkv):
            return False
        if self.qk_norm is None:
            return True
        if not (
            residual.plain_kernel_norm(self.q_norm) and residual.plain_kernel_norm(self.k_norm)
        ):
            return False
        return self.qk_norm == "head" or self.num_heads == self.num_kv_heads


def feed_forward(module: nn.Module, x: torch.Tensor) -> SubLayerOutput:
    """A layer's feed-forward on ``x``.  An MoE block that can (``can_keep_rows``)
    leaves its experts' rows un-summed, for the residual add to sum; not under a
    forward hook (tensor and sequence parallelism's), which needs the summed output."""
    if getattr(module, "can_keep_rows", False) and not module._forward_hooks:
        return module(x, keep_rows=True)
    return module(x)


class PreNormDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + ffn(norm(x))``, each add done by the next norm.

    A layer takes the previous layer's output and the residual stream before it
    (None at the first layer) and returns its own pair; the add of a pair is the
    next norm's (``layers/residual.add_norm``), where the kernels fuse them.
    ``ffn_name`` is the checkpoint's name for the feed-forward (``mlp`` or
    ``block_sparse_moe``): sharding and the weight maps find it by that name.
    """

    def __init__(
        self,
        make_norm: Callable[[], nn.Module],
        attn: nn.Module,
        ffn: nn.Module,
        ffn_name: str = "mlp",
    ) -> None:
        super().__init__()
        self.input_layernorm = make_norm()
        self.post_attention_layernorm = make_norm()
        self.self_attn = attn
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)

    def ffn(self, x: torch.Tensor) -> SubLayerOutput:
        return feed_forward(getattr(self, self.ffn_name), x)

    def forward(
        self,
        x: SubLayerOutput,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[SubLayerOutput, torch.Tensor]:
        h, residual = add_norm(self.input_layernorm, x, residual)
        h, residual = add_norm(self.post_attention_layernorm, self.self_attn(h, cos, sin), residual)
        return self.ffn(h), residual


class DecoderLM(MoEForCausalLM):
    """The causal-LM shell: embedding, decoder layers, final norm, lm_head (maybe tied).

    A family builds ``rotary`` and ``layers`` between ``_init_embedding`` and
    ``_init_head`` and maps one layer's tensors in ``_map_layer``.
    """

    rotary: RotaryEmbedding
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    tie_word_embeddings: bool
    weights: WeightMap

    def _init_embedding(self, config: dict) -> None:
        self.vocab_size = config["vocab_size"]
        self.embed_tokens = nn.Embedding(self.vocab_size, config["hidden_size"])

    def _init_head(self, config: dict, norm: nn.Module, *, lm_head_bias: bool = False) -> None:
        """Final norm and lm_head; then numbers the MoE blocks and builds the weight map."""
        self.norm = norm
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(config["hidden_size"], self.vocab_size, bias=lm_head_bias)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for n, block in enumerate(self.moe_blocks()):  # in layer order: moe_layer_indices
            block.moe_index = n
        self.weights = self._weight_map()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def position_encoding(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What every layer takes after the hidden states: rotary ``(cos, sin)`` here."""
        return self.rotary.cos_sin(positions, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        encoding = self.position_encoding(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, *encoding)
        return add_norm(self.norm, x, residual, keep_residual=False)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---------------------------------------------------------------- weights
    def _weight_map(self) -> WeightMap:
        wm = WeightMap(self)
        wm.direct("model.embed_tokens.weight", "embed_tokens.weight")
        for kind in _kinds(self.norm):
            wm.direct(f"model.norm.{kind}", f"norm.{kind}")
        if not self.tie_word_embeddings:
            wm.direct("lm_head.weight", "lm_head.weight")
        if self.lm_head.bias is not None:
            wm.direct("lm_head.bias", "lm_head.bias")
        for i, layer in enumerate(self.layers):
            self._map_layer(wm, i, layer, f"model.layers.{i}.", f"layers.{i}.")
        return wm

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        raise NotImplementedError

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.weights.load(name, tensor)

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets)


def map_norms(wm: WeightMap, layer: nn.Module, src: str, dst: str) -> None:
    """A layer's ``input_layernorm`` and ``post_attention_layernorm`` (with bias if they have one)."""
    for name in ("input_layernorm", "post_attention_layernorm"):
        for kind in _kinds(getattr(layer, name)):
            wm.direct(f"{src}{name}.{kind}", f"{dst}{name}.{kind}")


def map_fused_attention(wm: WeightMap, attn: FusedQKVAttention, src: str, dst: str) -> None:
    """Checkpoint q/k/v_proj onto rows of the fused ``qkv``; o_proj and q/k norms as they are."""
    starts = (0, attn.q_size, attn.q_size + attn.kv_size)
    sizes = (attn.q_size, attn.kv_size, attn.kv_size)
    for kind in _kinds(attn.qkv):
        for name, start, size in zip(QKV, starts, sizes, strict=True):
            wm.rows(f"{src}{name}.{kind}", f"{dst}qkv.{kind}", start, size)
    for kind in _kinds(attn.o_proj):
        wm.direct(f"{src}o_proj.{kind}", f"{dst}o_proj.{kind}")
    if attn.qk_norm is not None:
        for name in ("q_norm", "k_norm"):
            wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")


def map_experts(
    wm: WeightMap,
    experts: MoEExperts,
    src: str,
    dst: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> None:
    """Per-expert gate/up/down checkpoint tensors onto the stacked ``w13`` and ``w2``."""
    gate, up, down = names
    inter = experts.intermediate
    for e in range(experts.num_experts):
        ex = f"{src}{e}."
        wm.rows(f"{ex}{gate}.weight", f"{dst}w13", 0, inter, index=e)
        wm.rows(f"{ex}{up}.weight", f"{dst}w13", inter, inter, index=e)
        wm.direct(f"{ex}{down}.weight", f"{dst}w2", index=e)


def map_dense(wm: WeightMap, mlp: DenseMLP, src: str, dst: str) -> None:
    """A checkpoint's gate_proj/up_proj/down_proj onto a fused DenseMLP."""
    inter = mlp.down.shape[1]
    wm.rows(f"{src}gate_proj.weight", f"{dst}gate_up", 0, inter)
    wm.rows(f"{src}up_proj.weight", f"{dst}gate_up", inter, inter)
    wm.direct(f"{src}down_proj.weight", f"{dst}down")
