"""Routed experts: router selection functions and the experts' computation.

Selection functions return ``(weights, ids)`` with ids in router order
(descending score), exactly as the reference implementation of each family
picks them; the ids are what the trace records.  Beside each one, a
``*_weights`` function gives the weights that family's rule assigns to ids
chosen elsewhere (forced routing replays recorded ids, ``forced_routing.py``);
for the ids the selection itself picks, it gives the selection's weights.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.kernels.mxfp4_layout import LAYOUTS, from_fragment, scale_shape, to_fragment
from moetrace.layers.mxfp4 import FAST_SCALE_MAX, MXFP4_LAYOUT, dequantize_mxfp4
from moetrace.layers.residual import ExpertRows, SubLayerOutput


def _router_probs(router_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over every expert, in float32 (float64 for float64 logits)."""
    dtype = torch.float32 if router_logits.dtype != torch.float64 else torch.float64
    return F.softmax(router_logits, dim=-1, dtype=dtype)


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then top-k (Qwen-MoE, OLMoE, DeepSeek-V2 greedy)."""
    weights, ids = torch.topk(_router_probs(router_logits), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def softmax_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool
) -> torch.Tensor:
    """``softmax_topk``'s weights for ``ids``: their softmax shares (renormalised over them)."""
    weights = _router_probs(router_logits).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k on the raw logits, then softmax over the k (GraniteMoE, gpt-oss).

    The softmax keeps the logits' dtype: a caller whose reference upcasts first
    (GraniteMoE) passes float32 logits, one whose reference does not (gpt-oss)
    passes them in the model dtype.
    """
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return F.softmax(values, dim=-1, dtype=values.dtype), ids


def topk_softmax_weights(router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``topk_softmax``'s weights for ``ids``: a softmax over their logits."""
    values = router_logits.gather(1, ids)
    return F.softmax(values, dim=-1, dtype=values.dtype)


def _group_mask(group_scores: torch.Tensor, topk_groups: int, group_size: int) -> torch.Tensor:
    """bool [tokens, experts]: True for the experts of each token's best ``topk_groups`` groups."""
    best = torch.topk(group_scores, topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(group_size, dim=1)


def group_limited_softmax_topk(
    router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 ``group_limited_greedy``: softmax, keep the groups with the best single expert.

    Experts outside the kept groups get score 0 (not -inf), as in the reference,
    and the top-k runs over every expert.  Weights for given ids: their softmax
    shares, ``softmax_weights`` (a forced expert outside the groups this token's
    router would keep still gets its share, not 0).
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    tokens, experts = probs.shape
    size = experts // num_groups
    group_scores = probs.view(tokens, num_groups, size).amax(dim=-1)
    probs = probs.masked_fill(~_group_mask(group_scores, topk_groups, size), 0.0)
    return torch.topk(probs, top_k, dim=-1)


def sigmoid_group_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    *,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 (``noaux_tc``): experts picked by ``sigmoid + bias``, weighted by ``sigmoid``.

    Groups are ranked by the sum of their two best biased scores.  The ids come
    back in descending *selection* (biased) score: the trace's router order.
    """
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    tokens, experts = choice.shape
    size = experts // num_groups
    group_scores = choice.view(tokens, num_groups, size).topk(2, dim=-1).values.sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, topk_groups, size), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    return sigmoid_weights(router_logits, ids, renormalize=renormalize), ids


def sigmoid_weights(
    router_logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool
) -> torch.Tensor:
    """``sigmoid_group_topk``'s weights for ``ids``: unbiased sigmoid scores (renormalised)."""
    weights = router_logits.sigmoid().gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}

# Steps of up to this many tokens route through the fused Triton kernel where a
# layer's experts run on the fused-MoE kernel (``kernels/triton_routing.py``),
# prefill chunks included: with the pairs grouped in the same launch it beats
# the torch ops at every size measured (H200, docs/benchmarks.md).  The cap bounds its
# per-call table (experts x tokens int32: 32 MB at 128 experts); larger steps take
# the torch ops.  Decided by the step's size, so a captured graph always holds one
# path.  Its ids are CUDA ``torch.topk``'s on every row, ties included, and its
# float32 weights torch's to 1-2 units in the last place
# (``tests/kernels/test_gpu_routing.py``).  ``MOETRACE_FUSED_ROUTING=0`` turns it off.
FUSED_ROUTING_MAX_TOKENS = 0 if os.environ.get("MOETRACE_FUSED_ROUTING") == "0" else 65536


class RoutingRule(NamedTuple):
    """A family's selection rule in the terms of the fused routing kernel.

    ``scoring``: ``"softmax_topk"`` (``softmax_topk``) or ``"topk_softmax"``
    (``topk_softmax``).  Families whose rule the kernel lacks (grouped top-k,
    the sparsemixer) have none and always route through torch.
    """

    scoring: str
    renormalize: bool = False


class _PreparedRouting(NamedTuple):
    """Routing the fused kernels prepared for this layer's next experts' call."""

    weights: torch.Tensor
    ids: torch.Tensor
    weights_f32: torch.Tensor
    aligned: object  # kernels.triton_moe.AlignedRouting (Triton is imported only where it runs)


class _PendingCapture(NamedTuple):
    """What a layer's router recorded for the fused kernel to write during the experts' call."""

    ids: torch.Tensor
    destination: torch.Tensor
    weights: torch.Tensor
    weights_destination: torch.Tensor | None


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# Activations computed from (gate, up) together, not as act(gate) * up.
GATED_ACTIVATIONS = {"clamped_swiglu": clamped_swiglu}
# What the fused-MoE kernel computes ("gelu" here is erf's, which it lacks).
KERNEL_ACTIVATIONS = ("silu", "clamped_swiglu")
WEIGHT_FORMATS = ("dense", "mxfp4")


class MoEExperts(nn.Module):
    """Expert weights stacked per layer: gate and up fused, then down.

    ``w13[e]`` is ``[gate; up]`` of expert ``e`` (``2 * intermediate`` rows),
    ``w2[e]`` its down projection.  The plain path loops over the experts that
    got tokens; on CUDA the fused kernel serves.  Optional biases ``b13[e]``
    (gate then up) and ``b2[e]``.

    ``weight_format="mxfp4"`` keeps the weights MXFP4 (gpt-oss): ``w13 [E, 2I,
    H/2]`` and ``w2 [E, H, I/2]`` uint8, two e2m1 values a byte, with e8m0
    scales ``w13_scale`` and ``w2_scale``.  ``mxfp4_layout`` says how:
    ``"checkpoint"`` as checkpoints store them (scales ``[E, 2I, H/32]``,
    ``[E, H, I/32]``; the rows of ``w13`` alternating gate and up), or
    ``"fragment"`` (the default, ``layers/mxfp4.py``'s ``MXFP4_LAYOUT``),
    re-laid once by ``load_mxfp4`` for the kernel (``kernels/mxfp4_layout.py``;
    ``mxfp4_layout=`` overrides the default, for tests and benchmarks).
    The kernel decodes them in its K loop; the plain path decodes the experts
    it uses, at each call.  Either way the values are exact, so the model
    computes what a dequantized copy would, in a quarter of the memory.
    """

    kernel_half_only = True  # the fused-MoE tiles are tuned for 16-bit weights

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        activation: str = "silu",
        *,
        bias: bool = False,
        activation_args: dict | None = None,
        weight_format: str = "dense",
        mxfp4_layout: str | None = None,
    ) -> None:
        super().__init__()
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown expert weight format {weight_format!r}")
        if mxfp4_layout not in (None, *LAYOUTS):
            raise ValueError(f"unknown MXFP4 layout {mxfp4_layout!r}; have {LAYOUTS}")
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.activation = activation
        self.activation_args = dict(activation_args or {})
        self.mxfp4 = weight_format == "mxfp4"
        self.mxfp4_layout = mxfp4_layout or MXFP4_LAYOUT
        self.mxfp4_wide_scales = False  # a scale above the fast decoder's 128 (set at load)
        if self.mxfp4:
            if hidden % 32 or intermediate % 32:
                raise ModelError(
                    f"MXFP4 experts need widths in multiples of 32 (hidden {hidden}, "
                    f"intermediate {intermediate})"
                )
            byte = torch.uint8
            self.w13 = _frozen(torch.empty(num_experts, 2 * intermediate, hidden // 2, dtype=byte))
            self.w2 = _frozen(torch.empty(num_experts, hidden, intermediate // 2, dtype=byte))
            self.w13_scale = _frozen(self._scale_tensor(num_experts, 2 * intermediate, hidden))
            self.w2_scale = _frozen(self._scale_tensor(num_experts, hidden, intermediate))
        else:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
            self.register_parameter("w13_scale", None)
            self.register_parameter("w2_scale", None)
        if bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.register_parameter("b13", None)
            self.register_parameter("b2", None)
        self.kernel_capable = activation in KERNEL_ACTIVATIONS
        self.use_triton = False
        self._capture: _PendingCapture | None = None
        self._prepared: _PreparedRouting | None = None
        # The fused routing kernel's counters (zero between calls; ``route_and_align``),
        # made at the first fused call.
        self._grouping_work: torch.Tensor | None = None

    def can_route_fused(self, num_tokens: int) -> bool:
        """Whether the fused routing kernels may prepare this call (CUDA kernels only).

        Not with hooks on the experts (tensor and expert parallel rewrite the
        ids there), nor for a size ``moe_forward`` gives to ``grouped_mm``.
        """
        if not self.use_triton or num_tokens > FUSED_ROUTING_MAX_TOKENS:
            return False
        if self._forward_pre_hooks or self._forward_hooks:
            return False
        from moetrace.kernels.triton_moe import uses_grouped_mm

        return not uses_grouped_mm(num_tokens, self.w13.dtype, self._kernel_extras())

    def route_fused(
        self,
        logits: torch.Tensor,
        rule: RoutingRule,
        top_k: int,
        weights_dtype: torch.dtype,
        *,
        scaling: float | None = None,
        capture: torch.Tensor | None = None,
        capture_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, int32 ids) by ``rule`` in one launch, the pairs grouped for this
        call's tiles; ``capture``/``capture_weights`` receive ids and weights."""
        if self._prepared is not None or self._capture is not None:
            raise RuntimeError("routing: a layer's ids never reached its experts")
        from moetrace.kernels.triton_moe import moe_config
        from moetrace.kernels.triton_routing import grouping_work, route_and_align

        cfg = moe_config(
            logits.shape[0], top_k, self.num_experts, mxfp4=self.mxfp4, layout=self.mxfp4_layout
        )
        if self._grouping_work is None or self._grouping_work.device != logits.device:
            self._grouping_work = grouping_work(self.num_experts, logits.device)
        fused = route_and_align(
            logits,
            top_k,
            rule.scoring,
            cfg.block_m,
            renormalize=rule.renormalize,
            scaling=scaling,
            weights_dtype=weights_dtype,
            capture=capture,
            capture_weights=capture_weights,
            work=self._grouping_work,
            loaded_block_m=cfg.loaded_block_m,
        )
        self._prepared = _PreparedRouting(*fused)
        return fused.weights, fused.ids

    def capture_with(
        self,
        ids: torch.Tensor,
        destination: torch.Tensor,
        weights: torch.Tensor,
        weights_destination: torch.Tensor | None = None,
    ) -> None:
        """The block's router chose ``ids`` (and ``weights``): the next forward writes them
        to ``destination`` (and ``weights_destination``, when weights are captured)."""
        if self._capture is not None:
            raise RuntimeError("routing capture: a layer's ids never reached its experts")
        self._capture = _PendingCapture(ids, destination, weights, weights_destination)

    def _take_capture(
        self, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(ids destination, weights destination) for this call; None where nothing is captured."""
        pending, self._capture = self._capture, None
        if pending is None:
            return None, None
        # Only the very tensors the router recorded may be written in their place.
        if pending.ids is not ids or pending.weights is not weights:
            raise RuntimeError(
                "routing capture: the experts got other ids or weights than the router chose"
            )
        return pending.destination, pending.weights_destination

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *, keep_rows: bool = False
    ) -> SubLayerOutput:
        """``[T, H]``: each token's weighted sum of its experts' outputs.

        ``keep_rows``: on the kernels, the pairs' rows come back un-summed
        (``ExpertRows``) for the residual add to sum (``layers/residual.py``);
        not with forward hooks, which expect the sum (sequence parallelism's).
        """
        prepared, self._prepared = self._prepared, None
        if prepared is not None and (prepared.ids is not ids or prepared.weights is not weights):
            raise RuntimeError("routing: the experts got other ids or weights than prepared")
        # A prepared call's routing kernel wrote the capture already (route_fused refuses
        # a pending one), so this finds none then.
        capture, capture_weights = self._take_capture(ids, weights)
        if self.use_triton:
            from moetrace.kernels.triton_moe import moe_forward

            out = moe_forward(
                x,
                self.w13,
                self.w2,
                weights,
                ids,
                activation=self.activation,
                capture=capture,
                extras=self._kernel_extras(),
                capture_weights=capture_weights,
                aligned=None if prepared is None else prepared.aligned,
                weights_f32=None if prepared is None else prepared.weights_f32,
                combine=not (keep_rows and not self._forward_hooks),
            )
            return ExpertRows(out) if out.dim() == 3 else out
        if capture is not None:
            capture.copy_(ids)
        if capture_weights is not None:
            capture_weights.copy_(weights)
        return self.forward_torch(x, weights, ids)

    def forward_torch(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            w13, w2 = self._dense_weights(expert, x.dtype)
            # Biases are added after the matmul has rounded, as the reference does.
            gate_up = F.linear(x[tokens], w13)
            if self.mxfp4:  # rows alternate gate, up
                gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
            else:
                gate, up = gate_up.chunk(2, dim=-1)
            if self.b13 is not None:
                gate = gate + self.b13[expert, : self.intermediate]
                up = up + self.b13[expert, self.intermediate :]
            h = F.linear(self._glu(gate, up), w2)
            if self.b2 is not None:
                h = h + self.b2[expert]
            out.index_add_(0, tokens, h * weight_of[start : start + count, None].to(h.dtype))
            start += count
        return out

    def _scale_tensor(self, experts: int, rows: int, k: int) -> torch.Tensor:
        """Scales of ``[experts, rows, k]`` MXFP4 weights: ``[E, rows, k/32]`` as checkpoints
        store them, or ``[E, chunks, rows, 4]`` in the fragment layout."""
        if self.mxfp4_layout == "fragment":
            return torch.empty(experts, *scale_shape(rows, k), dtype=torch.uint8)
        return torch.empty(experts, rows, k // 32, dtype=torch.uint8)

    def load_mxfp4(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Store checkpoint MXFP4 ``blocks [E, N, K/2]`` and ``scales [E, N, K/32]`` as
        ``name`` (``"w13"``, rows alternating gate and up, or ``"w2"``) in this layout."""
        dst_blocks, dst_scales = getattr(self, name), getattr(self, f"{name}_scale")
        if self.mxfp4_layout == "checkpoint":
            dst_blocks.copy_(blocks)
            dst_scales.copy_(scales)
            return
        if int(scales.max()) > FAST_SCALE_MAX:  # at load: the one host sync is fine here
            self.mxfp4_wide_scales = True
        for e in range(blocks.shape[0]):  # one expert at a time: the repack's int64 temporaries
            packed, padded = to_fragment(
                blocks[e].to(dst_blocks.device),
                scales[e].to(dst_blocks.device),
                gate_up=name == "w13",
            )
            dst_blocks[e].copy_(packed)
            dst_scales[e].copy_(padded)

    def _dense_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's ``w13`` and ``w2`` as matrices (MXFP4 decoded, rows in checkpoint order:
        gate and up alternate)."""
        if not self.mxfp4:
            return self.w13[expert], self.w2[expert]
        mats = []
        for name in ("w13", "w2"):
            blocks, scales = getattr(self, name)[expert], getattr(self, f"{name}_scale")[expert]
            if self.mxfp4_layout == "fragment":
                blocks, scales = from_fragment(blocks, scales, gate_up=name == "w13")
            mats.append(dequantize_mxfp4(blocks.unflatten(-1, (-1, 16)), scales, dtype))
        return mats[0], mats[1]

    def _kernel_extras(self):
        """Biases, MXFP4 scales and SwiGLU settings for the fused kernel (None: plain experts)."""
        if self.b13 is None and not self.mxfp4 and self.activation not in GATED_ACTIVATIONS:
            return None
        from moetrace.kernels.triton_moe import ExpertExtras

        return ExpertExtras(
            b13=self.b13,
            b2=self.b2,
            w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
            interleaved=self.mxfp4,
            swiglu_alpha=float(self.activation_args.get("alpha", 1.702)),
            swiglu_limit=float(self.activation_args.get("limit", 7.0)),
            mxfp4_layout=self.mxfp4_layout if self.mxfp4 else "checkpoint",
            mxfp4_wide_scales=self.mxfp4_wide_scales,
        )

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation in GATED_ACTIVATIONS:
            return GATED_ACTIVATIONS[self.activation](gate, up, **self.activation_args)
        return ACTIVATIONS[self.activation](gate) * up


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """An integer parameter (quantized weights): no gradient."""
    return nn.Parameter(t, requires_grad=False)
