"""The residual stream between sub-layers: ``residual + out``, then the next norm.

Decoder layers pass ``(out, residual)`` on, and the next norm adds them
(``add_norm``): where the Triton kernels serve the norm, one launch does the
add, the norm and, for an MoE sub-layer, the sum of its top-k expert rows,
which then never go through a ``[T, H]`` tensor of their own
(``kernels/triton_residual.py``; the sum's float32 order is that kernel's,
see there).  Everywhere else the same torch ops as before run, in the same
order, so the plain path computes exactly what the layers always did.

``FUSED_NORMS`` false runs the unfused kernels instead (and the attention's
norms unfused, see ``models/common.py``): the tests hold the fused kernels
to the sequence they replace, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from moetrace.layers.norm import RMSNorm

# Read at each call, so a test may compare both in one process.
FUSED_NORMS = True


class ExpertRows(NamedTuple):
    """An MoE sub-layer's output before the sum over its top-k: ``rows.sum(1) (+ extra)``.

    The fused-MoE kernels hand each (token, expert) pair's weighted row back
    un-summed when the residual add will sum them (``MoEExperts.forward``'s
    ``keep_rows``).
    """

    rows: torch.Tensor  # [T, k, H]
    extra: torch.Tensor | None = None  # [T, H], added to the sum (shared experts)

    def total(self) -> torch.Tensor:
        """The output as torch sums it: what the experts returned before (``[T, H]``)."""
        out = self.rows.sum(dim=1) if self.rows.shape[1] > 1 else self.rows[:, 0]
        return out if self.extra is None else out + self.extra


SubLayerOutput = torch.Tensor | ExpertRows


def plus(out: SubLayerOutput, extra: torch.Tensor) -> SubLayerOutput:
    """``out + extra``; rows not yet summed take ``extra`` along, added after their sum."""
    if isinstance(out, ExpertRows):
        if out.extra is None:
            return ExpertRows(out.rows, extra)
        out = out.total()
    return out + extra


def total(out: SubLayerOutput) -> torch.Tensor:
    """``out`` as one ``[T, H]`` tensor."""
    return out.total() if isinstance(out, ExpertRows) else out


def sixteen_byte_rows(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor starts on a 16-byte boundary with row strides Triton can prove
    divisible by 16 (the only divisibility it specialises on).

    Triton lays a row out across a program's threads by what it can prove of
    the row's alignment, and a norm's sum of squares follows that layout.  The
    fused kernels sum in the unfused norm's order only where both see aligned
    rows, as every tensor the layers hand them is (measured on the H200: on an
    unaligned projection a few rows' norms moved by one unit).
    """
    for t in tensors:
        if t is None:
            continue
        if t.data_ptr() % 16 or any(s % 16 for s in t.stride()[:-1]) or t.stride(-1) != 1:
            return False
    return True


def kernel_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is an ``RMSNorm`` on its kernel, rounding either of the two ways
    that kernel does (``RMSNorm.weight_in_float32``); a subclass that overrides
    ``forward`` rounds its own way."""
    return isinstance(norm, RMSNorm) and norm.use_triton and type(norm).forward is RMSNorm.forward


def plain_kernel_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is a plain ``RMSNorm`` on its kernel (the weight times the rounded
    row), which every fused kernel rounds as."""
    return kernel_norm(norm) and not norm.weight_in_float32


def _fused(norm: nn.Module, out: SubLayerOutput, residual: torch.Tensor) -> bool:
    """Whether the add+norm kernel computes this norm: one on its kernel (``kernel_norm``),
    on aligned rows (``sixteen_byte_rows``)."""
    rows, extra = out if isinstance(out, ExpertRows) else (out, None)
    return (
        FUSED_NORMS
        and kernel_norm(norm)
        and residual.dtype in (torch.bfloat16, torch.float16)
        and sixteen_byte_rows(rows, extra, residual)
    )


def add_norm(
    norm: nn.Module,
    out: SubLayerOutput,
    residual: torch.Tensor | None,
    *,
    keep_residual: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(r), r)`` with ``r = residual + out``; ``residual`` None: ``out`` is the stream
    (the embedding, before the first layer).  Without ``keep_residual`` (the final norm)
    the kernel writes no ``r`` and None may come back."""
    if residual is None:
        out = total(out)
        return norm(out), out
    if _fused(norm, out, residual):
        from moetrace.kernels.triton_residual import add_rms_norm  # Triton only where it runs

        rows, extra = out if isinstance(out, ExpertRows) else (out, None)
        return add_rms_norm(
            rows,
            residual,
            norm.weight,
            norm.eps,
            extra=extra,
            keep_residual=keep_residual,
            weight_in_float32=norm.weight_in_float32,
        )
    residual = residual + total(out)
    return norm(residual), residual
