"""Rounding to a 16-bit dtype inside Triton kernels, where the reference rounds between ops.

A kernel computes in float32; the reference it must agree with (transformers'
eager modules) rounds every intermediate tensor to the model dtype.  Where
those roundings decide results (gpt-oss's attention scores, its SwiGLU),
kernels round the float32 value here and keep computing in float32.

Compiled for the H200, a cast down and back up (``v.to(bf16).to(fp32)``) was
folded away, so nothing was rounded.  The bfloat16 rounding is therefore the
conversion instruction as inline assembly, which nothing folds (two
instructions an element: ``tests/kernels/test_kernel_roundings_compiled.py``); the
interpreter runs no assembly, and there it works on the bits, as the float16
rounding does everywhere.  Both give torch's casts bit for bit
(``tests/kernels/test_triton_rounding.py``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter runs no assembly: there the rounding works on the bits.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_to_bf16(v):
    """float32 to the nearest bfloat16 (ties to even), kept in float32."""
    if _INTERPRETED:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $1, $1; and.b32 $0, t, 0xffff0000; }",
            constraints="=r,r",
            args=[v],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return out


@triton.jit
def round_to_fp16(v):
    """float32 to the nearest float16 (ties to even), kept in float32.

    On the bits in float16's normal range; past 65504 it is infinite, and below
    2**-14 (subnormal in float16) the plain casts serve.
    """
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + 0xFFF + ((bits >> 13) & 1)) >> 13) << 13
    r = bits.to(tl.float32, bitcast=True)
    r = tl.where(tl.abs(r) > 65504.0, v * float("inf"), r)
    return tl.where(tl.abs(v) < 6.103515625e-05, v.to(tl.float16).to(tl.float32), r)


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """``v`` rounded as a tensor of ``dtype`` would hold it (float32 and wider: unchanged)."""
    if dtype == tl.bfloat16:
        return round_to_bf16(v)
    elif dtype == tl.float16:
        return round_to_fp16(v)
    else:
        return v


@triton.jit
def narrow(v, dtype: tl.constexpr):
    """``v``, a float32 already holding a value of ``dtype``, stored as ``dtype`` exactly.

    bfloat16 as the top half of the bits: the interpreter's cast truncates and
    mangles subnormals (the GPU's rounds; on rounded values both are exact).
    """
    if dtype == tl.bfloat16:
        out = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(dtype)
    return out
