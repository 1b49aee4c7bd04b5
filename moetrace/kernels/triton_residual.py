"""The residual add, an MoE layer's top-k sum and the next RMSNorm in one Triton launch.

A decoder layer ends each sub-layer with ``residual + out`` and the next
sub-layer starts with ``norm(residual)``; an MoE sub-layer's ``out`` is the
sum of its top-k expert rows first.  On the torch path those are three
launches (the top-k reduce, the add, the norm), each reading and writing
``[T, H]``; here one program per token reads the rows (or the one output),
the residual and the norm's weight once and writes the new residual and the
normed row (``layers/residual.py`` decides where it serves).

Rounding, step by step as the unfused sequence rounds:

* the top-k rows are added in float32 in row order (0, 1, ..., k - 1) and
  rounded once to the model dtype.  torch's CUDA reduction also adds them in
  float32 and rounds once, but in an order of its own, which cannot be
  reproduced reliably: the two sums can differ in the last float32 bit
  before the rounding, so a 16-bit result rarely moves by one unit;
* ``extra`` (shared experts) is added to the rounded sum and rounded, as
  ``routed + shared`` is;
* the residual add in float32, rounded to the model dtype: torch's 16-bit
  add, bit for bit;
* the norm as ``triton_norm._rms_norm_kernel`` computes it on that row: the
  same 1-D block and warps, the same reduction (``rms_rstd``) and roundings
  (``rms_scale``; with ``weight_in_float32``, gpt-oss's, the weight times the
  float32 row, rounded once), so the normed row is bit-identical to that kernel's
  where the rows are 16-byte aligned, as the layers check
  (``layers/residual.sixteen_byte_rows``: Triton lays a row out by the
  alignment it can prove, and the sum follows the layout).

Roundings and stores work on the bits (``triton_rounding``), so the
interpreter (``TRITON_INTERPRET=1``) computes what the GPU does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrace.kernels.triton_norm import norm_launch, rms_rstd, rms_scale
from moetrace.kernels.triton_rounding import narrow, round_to


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    extra_ptr,
    res_ptr,
    w_ptr,
    res_out_ptr,
    out_ptr,
    stride_xt,
    stride_xk,
    stride_et,
    stride_rt,
    dim,
    inv_dim,
    eps,
    ROWS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    WEIGHT_IN_FLOAT32: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token ``t``: ``r = residual + (sum of ROWS rows [+ extra])``; store ``r`` and ``norm(r)``."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    ty: tl.constexpr = out_ptr.dtype.element_ty
    # Every load first: one issued after the norm's cross-warp sum waits out its own latency.
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    src = x_ptr + t * stride_xt + d
    s = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(1, ROWS):
        s += tl.load(src + j * stride_xk, mask=ok, other=0.0).to(tl.float32)
    if ROWS > 1:
        s = round_to(s, ty)
    if HAS_EXTRA:
        e = tl.load(extra_ptr + t * stride_et + d, mask=ok, other=0.0).to(tl.float32)
        s = round_to(s + e, ty)
    r = tl.load(res_ptr + t * stride_rt + d, mask=ok, other=0.0).to(tl.float32)
    x = round_to(r + s, ty)
    if STORE_RESIDUAL:
        tl.store(res_out_ptr + t * dim + d, narrow(x, ty), mask=ok)
    rstd = rms_rstd(x, inv_dim, eps)
    if WEIGHT_IN_FLOAT32:
        y = round_to(w * (x * rstd), ty)
    else:
        y = rms_scale(x, rstd, w, ty)
    tl.store(out_ptr + t * dim + d, narrow(y, ty), mask=ok)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[T, k, H]`` (a 2-D output is one row) with unit stride along ``H``."""
    if x.dim() == 2:
        x = x[:, None, :]
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    extra: torch.Tensor | None = None,
    keep_residual: bool = True,
    weight_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(r), r)`` for ``r = residual + x`` (see the module doc for the roundings;
    ``weight_in_float32`` as ``triton_norm.rms_norm``'s).

    ``x``: a sub-layer's output ``[T, H]``, or an MoE layer's un-summed rows
    ``[T, k, H]`` (summed first); ``extra [T, H]`` is added to that sum before
    the residual (shared experts).  16-bit dtypes, all alike.  Without
    ``keep_residual`` (the final norm) ``r`` is not written and None returned.
    """
    rows = _rows_of(x)
    t, k, d = rows.shape
    if residual.shape != (t, d) or weight.shape != (d,):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    if extra is not None and (extra.shape != (t, d) or extra.dtype != residual.dtype):
        raise ValueError(f"add_rms_norm: extra {tuple(extra.shape)} does not fit {(t, d)}")
    if residual.dtype not in (torch.bfloat16, torch.float16) or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm rounds like 16-bit dtypes, got {x.dtype}/{residual.dtype}")
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    if extra is not None and extra.stride(-1) != 1:
        extra = extra.contiguous()
    out = torch.empty((t, d), dtype=residual.dtype, device=residual.device)
    new_residual = torch.empty_like(out) if keep_residual else None
    if t == 0:
        return out, new_residual
    launch = norm_launch(d)
    _add_rms_norm_kernel[(t,)](
        rows,
        rows if extra is None else extra,  # unused without extra
        residual,
        weight,
        out if new_residual is None else new_residual,  # unused without keep_residual
        out,
        rows.stride(0),
        rows.stride(1),
        0 if extra is None else extra.stride(0),
        residual.stride(0),
        d,
        launch.inv_dim,
        eps,
        ROWS=k,
        HAS_EXTRA=extra is not None,
        STORE_RESIDUAL=keep_residual,
        WEIGHT_IN_FLOAT32=weight_in_float32,
        BLOCK_D=launch.block,
        num_warps=launch.num_warps,  # rms_norm's: the sum's order follows the layout
        enable_fp_fusion=False,  # as rms_norm: no product fused into an add
    )
    return out, new_residual
