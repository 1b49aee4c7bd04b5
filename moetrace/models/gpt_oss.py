"""gpt-oss (``GptOssForCausalLM``): router with bias, top-k on the logits, softmax over the k.

Every layer routes.  Attention has q/k/v/o biases and a learned per-head sink
logit (an extra softmax column that takes probability mass and no value);
layers alternate sliding-window and full attention as ``layer_types`` says;
rope is YaRN.  Experts have biases and a clamped SwiGLU
(``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``).

Checkpoints keep each layer's experts fused: ``mlp.experts.gate_up_proj
[E, H, 2I]`` with gate and up *interleaved* along the last axis (gate even
columns, up odd), ``gate_up_proj_bias [E, 2I]`` likewise, ``down_proj
[E, I, H]``, ``down_proj_bias [E, H]``; we transpose and de-interleave them
into ``MoEExperts``' ``w13``/``w2`` at load.  Published checkpoints store
the two expert matrices as MXFP4 (``*_blocks``/``*_scales``, see ``mxfp4.py``),
dequantized at load into the model dtype.

Sinks and the clamped SwiGLU are not in the Triton kernels: attention and
experts take the plain-torch path on every device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts, topk_softmax
from moetrace.layers.norm import RMSNorm
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.mxfp4 import dequantize_mxfp4, quant_method
from moetrace.models.weights import WeightMap

RMS_EPS = 1e-5
QKV = ("q_proj", "k_proj", "v_proj")
ROPE_THETA = 150000.0  # GptOssConfig's defaults, for configs that give no rope settings
DEFAULT_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss_rope(config: dict) -> tuple[float, dict]:
    theta, scaling = rope_settings(config)
    given = "rope_theta" in config or "rope_theta" in (config.get("rope_parameters") or {})
    theta = theta if given else ROPE_THETA
    has_type = "rope_type" in scaling or "type" in scaling
    return theta, scaling if has_type else {**DEFAULT_YARN, **scaling}


def gpt_oss_layer_types(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelError(f"gpt-oss layer_types {types} do not fit {n} layers")
    return list(types)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Even entries along ``dim`` (gate), then the odd ones (up)."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


class GptOssRMSNorm(RMSNorm):
    """The weight multiplies in float32, before the cast back (the reference keeps it fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * h).to(x.dtype)


class GptOssBlock(MoEBlockBase):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        num_experts = config["num_local_experts"]
        self.top_k = config["num_experts_per_tok"]
        self.router = nn.Linear(hidden, num_experts, bias=True)
        swiglu = {
            "alpha": float(config.get("swiglu_alpha", 1.702)),
            "limit": float(config.get("swiglu_limit", 7.0)),
        }
        self.experts = MoEExperts(
            num_experts,
            hidden,
            config["intermediate_size"],
            "clamped_swiglu",
            bias=True,
            activation_args=swiglu,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Logits, top-k and softmax all in the model dtype, as the reference.
        weights, ids = topk_softmax(self.router(x), self.top_k)
        self.record(ids)
        return self.experts(x, weights, ids)


class GptOssAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, sliding: bool) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(config.get("attention_bias", True))
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias)
        self.rotary = rotary
        window = config.get("sliding_window", 128) if sliding else None
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=window or None,
        )
        self.attn.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(t, -1))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, sliding: bool) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.input_layernorm = GptOssRMSNorm(hidden, eps)
        self.post_attention_layernorm = GptOssRMSNorm(hidden, eps)
        self.self_attn = GptOssAttention(config, rotary, sliding)
        self.mlp = GptOssBlock(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(MoEForCausalLM):
    architecture = "GptOssForCausalLM"

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.quantization = quant_method(config)
        if self.quantization not in (None, "mxfp4"):
            raise ModelError(
                f"gpt-oss checkpoint quantized with {self.quantization!r}; "
                "moetrace reads plain or MXFP4 experts"
            )
        self.config = config
        hidden = config["hidden_size"]
        self.vocab_size = config["vocab_size"]
        self.num_experts = int(config.get("num_local_experts") or 0)
        if self.num_experts <= 0:
            raise ModelError("gpt-oss config has no num_local_experts")
        self.top_k = config["num_experts_per_tok"]
        layer_types = gpt_oss_layer_types(config)
        self.moe_layer_indices = list(range(len(layer_types)))
        self.max_model_len = int(config.get("max_position_embeddings", 131072))
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        theta, scaling = gpt_oss_rope(config)
        self.rotary = RotaryEmbedding(
            head_dim, theta, scaling, max_position_embeddings=self.max_model_len
        )
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, self.rotary, kind == "sliding_attention")
            for kind in layer_types
        )
        for i, layer in enumerate(self.layers):
            layer.mlp.moe_index = i
        self.norm = GptOssRMSNorm(hidden, config.get("rms_norm_eps", RMS_EPS))
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.weights = self._weight_map()
        self._pending: dict[str, torch.Tensor] = {}  # MXFP4 halves waiting for their partner
        self.converters = self._expert_converters()

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
            kinds = ("weight", "bias") if attn.qkv.bias is not None else ("weight",)
            for kind in kinds:
                for name, start, size in zip(QKV, starts, sizes, strict=True):
                    wm.rows(
                        f"{src}self_attn.{name}.{kind}", f"{dst}self_attn.qkv.{kind}", start, size
                    )
                wm.direct(f"{src}self_attn.o_proj.{kind}", f"{dst}self_attn.o_proj.{kind}")
            wm.direct(f"{src}self_attn.sinks", f"{dst}self_attn.attn.sinks")
            for name in ("input_layernorm", "post_attention_layernorm"):
                wm.direct(f"{src}{name}.weight", f"{dst}{name}.weight")
            for kind in ("weight", "bias"):
                wm.direct(f"{src}mlp.router.{kind}", f"{dst}mlp.router.{kind}")
            wm.direct(f"{src}mlp.experts.down_proj_bias", f"{dst}mlp.experts.b2")
        return wm

    def _expert_converters(self) -> dict[str, Callable[[str, torch.Tensor], None]]:
        """Checkpoint names whose tensors need more than a copy: transposes, interleave, MXFP4."""
        conv: dict[str, Callable[[str, torch.Tensor], None]] = {}
        for i, layer in enumerate(self.layers):
            src, experts = f"model.layers.{i}.mlp.experts.", layer.mlp.experts
            conv[f"{src}gate_up_proj_bias"] = _bias_loader(experts)
            if self.quantization == "mxfp4":
                for proj in ("gate_up_proj", "down_proj"):
                    pair = _mxfp4_loader(self._pending, f"{src}{proj}", experts, proj)
                    conv[f"{src}{proj}_blocks"] = conv[f"{src}{proj}_scales"] = pair
            else:
                conv[f"{src}gate_up_proj"] = _gate_up_loader(experts)
                conv[f"{src}down_proj"] = _down_loader(experts)
        return conv

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        convert = self.converters.get(name)
        if convert is None:
            return self.weights.load(name, tensor)
        with torch.no_grad():
            convert(name, tensor)
        return True

    def expected_weight_names(self) -> set[str]:
        return set(self.weights.targets) | set(self.converters)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")


def _gate_up_loader(experts: MoEExperts) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, t: torch.Tensor) -> None:  # [E, H, 2I], gate/up interleaved
        e, rows, hidden = experts.w13.shape
        _check(name, t, (e, hidden, rows))
        experts.w13.copy_(deinterleave(t.transpose(1, 2), dim=1))

    return load


def _down_loader(experts: MoEExperts) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, t: torch.Tensor) -> None:  # [E, I, H]
        e, hidden, inter = experts.w2.shape
        _check(name, t, (e, inter, hidden))
        experts.w2.copy_(t.transpose(1, 2))

    return load


def _bias_loader(experts: MoEExperts) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, t: torch.Tensor) -> None:  # [E, 2I], gate/up interleaved
        _check(name, t, tuple(experts.b13.shape))
        experts.b13.copy_(deinterleave(t, dim=1))

    return load


def _mxfp4_loader(
    pending: dict[str, torch.Tensor], base: str, experts: MoEExperts, proj: str
) -> Callable[[str, torch.Tensor], None]:
    """Holds whichever of blocks/scales comes first (shards may split them), then dequantizes.

    Dequantized, ``gate_up_proj`` is ``[E, 2I, H]`` with interleaved rows and
    ``down_proj`` is ``[E, H, I]``: ``w2`` as is.  One expert at a time, to
    bound the float32 scratch.
    """
    target = experts.w13 if proj == "gate_up_proj" else experts.w2

    def load(name: str, t: torch.Tensor) -> None:
        pending[name] = t
        blocks, scales = pending.get(f"{base}_blocks"), pending.get(f"{base}_scales")
        if blocks is None or scales is None:
            return
        del pending[f"{base}_blocks"], pending[f"{base}_scales"]
        experts_, rows, cols = target.shape
        _check(f"{base}_blocks", blocks, (experts_, rows, cols // 32, 16))
        _check(f"{base}_scales", scales, (experts_, rows, cols // 32))
        for e in range(target.shape[0]):
            dense = dequantize_mxfp4(blocks[e], scales[e], target.dtype)
            target[e].copy_(deinterleave(dense, dim=0) if proj == "gate_up_proj" else dense)

    return load
