"""Triton RMSNorm and rotary embedding: one launch each where torch takes five or six.

In a decode step at batch 256 the MoE and attention kernels are large, and
what remains is dozens of tiny elementwise launches per layer (the float32
cast, square, mean, rsqrt and two products of a norm; slices, negation,
concatenation and three products of a rotary embedding).  These kernels do
the same arithmetic in one pass each and round where the reference rounds:

* RMSNorm: float32 statistics as torch's CUDA ops round them (the mean is
  the sum times ``float32(1 / dim)``, then eps is added; no FMA), the
  normalised row cast to the input dtype, then multiplied by the weight in
  that dtype (as transformers' modules do; gpt-oss's multiplies the float32
  row and rounds once).
* Rotary (half-split layout): ``x * cos`` and ``rotate_half(x) * sin`` each
  rounded to the input dtype before their sum, which is rounded again: the
  three roundings of the torch expression, done on the bits (see
  ``triton_rounding``), so results are bit-identical.  bfloat16 only.

Both take ``[rows, heads, dim]`` inputs with any row and head strides (views
of a fused QKV projection) and write a contiguous output.  The norm takes
16-bit dtypes only (``RMSNorm.kernel_half_only``): those it is checked in
against the plain path; float32 runs take the plain path.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from moetrace.kernels.triton_rounding import round_to


class NormLaunch(NamedTuple):
    """How ``rms_norm`` reduces a row of ``dim`` values: its block, the float32
    ``1 / dim`` it scales the sum by (as torch's CUDA mean does), its warps."""

    block: int
    inv_dim: float
    num_warps: int


def norm_launch(dim: int) -> NormLaunch:
    """``rms_norm``'s launch for rows of ``dim``: a kernel that must sum a row's squares
    as it does (``rms_rstd``) launches with the same block and warps, since the
    order of the sum follows the layout."""
    block = triton.next_power_of_2(dim)
    return NormLaunch(block, float(np.float32(1.0) / np.float32(dim)), min(8, max(1, block // 256)))


@triton.jit
def rms_rstd(x, inv_dim, eps):
    """``1 / sqrt(mean(x**2) + eps)`` of a float32 row ``[BLOCK]``, as torch's CUDA ops round it.

    The mean is the sum times ``float32(1 / dim)``, then eps is added; kernels
    using it launch without FMA contraction.  Every kernel that must give
    ``_rms_norm_kernel``'s result reduces through here, over the same 1-D
    block with the same warps (the order of the sum follows the layout).
    """
    return tl.rsqrt(tl.sum(x * x, 0) * inv_dim + eps)  # libdevice rsqrtf, as torch's CUDA rsqrt


@triton.jit
def rms_scale(x, rstd, w, dtype: tl.constexpr):
    """``w * (x * rstd)`` rounded to ``dtype`` after each product, as ``_rms_norm_kernel``
    rounds, on the bits (kept in float32, so a caller may keep computing exactly)."""
    return round_to(w * round_to(x * rstd, dtype), dtype)


@triton.jit
def rotate_halves(f1, f2, c1, c2, s1, s2, dtype: tl.constexpr):
    """Half-split rotary of the halves ``f1``/``f2`` (float32 holding ``dtype`` values).

    ``x * cos + cat(-x2, x1) * sin``: each product and the sum rounded to
    ``dtype``, the torch expression's three roundings (a product of two 16-bit
    values is exact in float32).  Returns the (first, second) halves.
    """
    lo = round_to(round_to(f1 * c1, dtype) + round_to(-(f2 * s1), dtype), dtype)
    hi = round_to(round_to(f2 * c2, dtype) + round_to(f1 * s2, dtype), dtype)
    return lo, hi


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    dim,
    inv_dim,
    eps,
    BLOCK_D: tl.constexpr,
    WEIGHT_IN_FLOAT32: tl.constexpr,
):
    row = tl.program_id(0)
    t = (row // num_heads).to(tl.int64)
    h = row % num_heads
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)  # before the sum's barriers
    rstd = rms_rstd(x, inv_dim, eps)  # launched without FMA contraction, see ``rms_norm``
    if WEIGHT_IN_FLOAT32:  # gpt-oss: the weight multiplies the float32 row, one rounding
        y = (w * (x * rstd)).to(out_ptr.dtype.element_ty)
    else:
        normed = (x * rstd).to(out_ptr.dtype.element_ty)
        y = (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * dim + d, y, mask=ok)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` as [T, H, D] with unit stride on D: (view, T, H, D)."""
    if x.dim() == 2:
        x = x[:, None, :]
    if x.dim() != 3 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
    return x, x.shape[0], x.shape[1], x.shape[2]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_in_float32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension of a 2-D or 3-D tensor; output contiguous, like ``x``.

    ``weight_in_float32``: the weight multiplies the float32 normalised row and
    the product is rounded once (gpt-oss), instead of after the row's rounding.
    """
    shape = x.shape
    rows, t, h, d = _as_rows(x)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if t * h == 0:
        return out
    launch = norm_launch(d)
    _rms_norm_kernel[(t * h,)](
        rows,
        weight,
        out,
        h,
        rows.stride(0),
        rows.stride(1),
        d,
        launch.inv_dim,
        eps,
        BLOCK_D=launch.block,
        WEIGHT_IN_FLOAT32=weight_in_float32,
        num_warps=launch.num_warps,
        # torch squares, sums, scales and adds eps in separate roundings: no
        # product may fuse into an add.  Memory-bound: costs nothing measurable.
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ct,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ok = (h[:, None] < num_heads) & (i[None, :] < HALF)
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    # cos/sin rows are [cos(f), cos(f)]: the two halves share the same angles,
    # but read both, as the reference multiplies by each half's own entries.
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=i < HALF, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=i < HALF, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=i < HALF, other=0.0)[None, :]
    ty = out_ptr.dtype.element_ty
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    c1, c2, s1, s2 = c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32)
    lo, hi = rotate_halves(f1, f2, c1, c2, s1, s2, tl.bfloat16)
    dst = out_ptr + (t * num_heads + h[:, None]) * (2 * HALF) + i[None, :]
    tl.store(dst, lo.to(ty), mask=ok)
    tl.store(dst + HALF, hi.to(ty), mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of ``x [T, H, D]`` with ``cos``/``sin`` ``[T, D]``."""
    t, h, d = x.shape
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the rotary kernel rounds like bfloat16 only, got {x.dtype}")
    if cos.shape != (t, d) or sin.shape != (t, d) or d % 2:
        raise ValueError(f"rotary: x {tuple(x.shape)} vs cos {tuple(cos.shape)}")
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // (2 * block_half)))
    _rotary_kernel[(t, triton.cdiv(h, block_h))](
        x,
        cos,
        sin,
        out,
        h,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return out
