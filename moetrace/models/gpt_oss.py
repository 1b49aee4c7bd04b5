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
the two expert matrices as MXFP4 (``*_blocks``/``*_scales``, see
``layers/mxfp4.py``): those stay MXFP4, re-laid once at load for the fused-MoE
kernel (``kernels/mxfp4_layout.py``; ``MOETRACE_MXFP4_LAYOUT=checkpoint`` keeps
the checkpoint's own, interleaved rows included), and the kernels decode them
as they multiply.
Biases are de-interleaved either way.

Sinks, expert biases, the clamped SwiGLU and MXFP4 are all in the Triton
kernels, which round where transformers' eager gpt-oss rounds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.moe import MoEExperts, RoutingRule, topk_softmax, topk_softmax_weights
from moetrace.layers.mxfp4 import quant_method
from moetrace.layers.norm import RMSNorm
from moetrace.layers.residual import SubLayerOutput
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase
from moetrace.models.common import (
    DecoderLM,
    FusedQKVAttention,
    PreNormDecoderLayer,
    head_dim_of,
    map_fused_attention,
    map_norms,
)
from moetrace.models.weights import WeightMap, check_kind

RMS_EPS = 1e-5
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

    weight_in_float32 = True


class GptOssBlock(MoEBlockBase):
    can_keep_rows = True  # its output is the experts': the residual add may sum their rows

    def __init__(self, config: dict, weight_format: str) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        num_experts = config["num_local_experts"]
        self.top_k = config["num_experts_per_tok"]
        self.router = nn.Linear(hidden, num_experts, bias=True)
        # bf16 logits (the reference does not upcast): the kernel reads their values, ranks
        # them as torch.topk does and rounds the softmax over the k to the model dtype.
        self.routing_rule = RoutingRule("topk_softmax")
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
            weight_format=weight_format,
        )

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_softmax(logits, self.top_k)

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return topk_softmax_weights(logits, ids)

    def forward(self, x: torch.Tensor, *, keep_rows: bool = False) -> SubLayerOutput:
        # Logits, top-k and softmax all in the model dtype, as the reference.
        weights, ids = self.route_and_record(self.router(x), x.dtype)
        return self.experts(x, weights, ids, keep_rows=keep_rows)


class GptOssAttention(FusedQKVAttention):
    """Fused-qkv attention plus a learned per-head sink logit."""

    def __init__(self, config: dict, rotary: RotaryEmbedding, sliding: bool) -> None:
        window = config.get("sliding_window", 128) if sliding else None
        bias = bool(config.get("attention_bias", True))
        super().__init__(config, rotary, bias=bias, window=window or None)
        self.attn.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssForCausalLM(DecoderLM):
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
        self.num_experts = int(config.get("num_local_experts") or 0)
        if self.num_experts <= 0:
            raise ModelError("gpt-oss config has no num_local_experts")
        self.top_k = config["num_experts_per_tok"]
        layer_types = gpt_oss_layer_types(config)
        self.moe_layer_indices = list(range(len(layer_types)))
        self.max_model_len = int(config.get("max_position_embeddings", 131072))
        theta, scaling = gpt_oss_rope(config)
        self.rotary = RotaryEmbedding(
            head_dim_of(config), theta, scaling, max_position_embeddings=self.max_model_len
        )
        self._init_embedding(config)
        eps = config.get("rms_norm_eps", RMS_EPS)
        self.layers = nn.ModuleList(
            PreNormDecoderLayer(
                lambda: GptOssRMSNorm(hidden, eps),
                GptOssAttention(config, self.rotary, kind == "sliding_attention"),
                GptOssBlock(config, "mxfp4" if self.quantization == "mxfp4" else "dense"),
            )
            for kind in layer_types
        )
        self._init_head(config, GptOssRMSNorm(hidden, eps))
        self._pending: dict[str, torch.Tensor] = {}  # MXFP4 halves waiting for their partner
        self.converters = self._expert_converters()

    # ---------------------------------------------------------------- weights
    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        map_fused_attention(wm, layer.self_attn, f"{src}self_attn.", f"{dst}self_attn.")
        wm.direct(f"{src}self_attn.sinks", f"{dst}self_attn.attn.sinks")
        map_norms(wm, layer, src, dst)
        for kind in ("weight", "bias"):
            wm.direct(f"{src}mlp.router.{kind}", f"{dst}mlp.router.{kind}")
        wm.direct(f"{src}mlp.experts.down_proj_bias", f"{dst}mlp.experts.b2")

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


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    check_kind(name, tensor, dtype)


def _gate_up_loader(experts: MoEExperts) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, t: torch.Tensor) -> None:  # [E, H, 2I], gate/up interleaved
        e, rows, hidden = experts.w13.shape
        _check(name, t, (e, hidden, rows), experts.w13.dtype)
        experts.w13.copy_(deinterleave(t.transpose(1, 2), dim=1))

    return load


def _down_loader(experts: MoEExperts) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, t: torch.Tensor) -> None:  # [E, I, H]
        e, hidden, inter = experts.w2.shape
        _check(name, t, (e, inter, hidden), experts.w2.dtype)
        experts.w2.copy_(t.transpose(1, 2))

    return load


def _bias_loader(experts: MoEExperts) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, t: torch.Tensor) -> None:  # [E, 2I], gate/up interleaved
        _check(name, t, tuple(experts.b13.shape), experts.b13.dtype)
        experts.b13.copy_(deinterleave(t, dim=1))

    return load


def _mxfp4_loader(
    pending: dict[str, torch.Tensor], base: str, experts: MoEExperts, proj: str
) -> Callable[[str, torch.Tensor], None]:
    """Holds whichever of blocks/scales comes first (shards may split them), then stores both.

    ``gate_up_proj_blocks [E, 2I, H/32, 16]`` (rows interleaved) and
    ``down_proj_blocks [E, H, I/32, 16]`` are ``w13`` and ``w2``, their
    scales ``w13_scale`` and ``w2_scale``; ``MoEExperts.load_mxfp4`` re-lays
    them for the kernel (``kernels/mxfp4_layout.py``) unless the experts keep
    the checkpoint layout.
    """
    name = "w13" if proj == "gate_up_proj" else "w2"

    def load(key: str, t: torch.Tensor) -> None:
        pending[key] = t
        blocks, scales = pending.get(f"{base}_blocks"), pending.get(f"{base}_scales")
        if blocks is None or scales is None:
            return
        del pending[f"{base}_blocks"], pending[f"{base}_scales"]
        e, rows, half_k = getattr(experts, name).shape
        groups = half_k // 16
        _check(f"{base}_blocks", blocks, (e, rows, groups, 16), getattr(experts, name).dtype)
        _check(f"{base}_scales", scales, (e, rows, groups), getattr(experts, f"{name}_scale").dtype)
        experts.load_mxfp4(name, blocks.reshape(e, rows, groups * 16), scales)

    return load
