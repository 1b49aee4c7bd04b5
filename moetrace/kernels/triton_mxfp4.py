"""Decoding fragment-layout MXFP4 weights inside Triton kernels (``kernels/mxfp4_layout.py``).

``fragment_tile`` loads a K step's words and scales of a block of rows: each
lane's words of a chunk are one 16-byte load and a warp's loads cover whole
rows.  ``fragment_operand`` turns a tile of 32-bit words into the left operand of
``tl.dot``: built from the words by joins, a permute and a reshape that only
relabel registers, since each word already holds what one lane needs.  Two
decoders compute the same values:

* ``FAST`` (CUDA, bfloat16): per word one inline-assembly block of 11 integer
  operations and 4 packed bf16 multiplies yields four bf16x2 registers
  (the pair bits read as value times ``2**-126``, multiplied by
  ``2**(s - 1)``).  Exact for scales ``s <= 128`` (values up to ``6 * 2**1``);
  PTX's bf16 multiply keeps subnormals (``0.5 * 2**-126`` is one), and the
  GPU tests check every code at both ends of that range.
* generic (any dtype, and the interpreter, which runs no assembly): the
  codes taken apart with integer operations, each value built in float32
  from float16 bits as the checkpoint-layout decoder does; scales up to 240.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrace.kernels.mxfp4_layout import FAST_DECODE_PTX

_FAST_DECODE_PTX = tl.constexpr(FAST_DECODE_PTX)  # a jit function reads constexpr globals only


@triton.jit
def _fast_pairs(words, factors):
    """int32 words and bf16x2 factors ``[f|f]`` to four int32 registers of two bf16 each."""
    return tl.inline_asm_elementwise(
        asm=_FAST_DECODE_PTX,
        constraints="=r,=r,=r,=r,r,r",
        args=[words, factors],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _bf16_halves(pair):
    """An int32 of two bf16 (lane 0 low) as its two values."""
    lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _code(words, SIGN: tl.constexpr, M0: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr):
    """The e2m1 code (sign bit 3, exponent bits 2..1, mantissa bit 0) at the given positions."""
    return (
        (((words >> SIGN) & 1) << 3)
        | (((words >> E1) & 1) << 2)
        | (((words >> E0) & 1) << 1)
        | ((words >> M0) & 1)
    )


@triton.jit
def _code_value(code, factor, DTYPE: tl.constexpr):
    """Code and float32 ``2**(s - 113)`` to the value in ``DTYPE``, exactly.

    The code in float16's sign, exponent and top mantissa bits reads as its
    value times ``2**-14`` (0.5 as a subnormal, which widening to float32 keeps).
    """
    half = ((code & 7) << 9) | ((code & 8) << 12)
    return (half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * factor).to(DTYPE)


@triton.jit
def _generic_pair(words, factor, Q: tl.constexpr, DTYPE: tl.constexpr):
    """Pair ``Q``'s two values (lanes 0 and 1) by integer operations (see module doc)."""
    if Q == 0:
        lo = _code_value(_code(words, 15, 6, 7, 8), factor, DTYPE)
        hi = _code_value(_code(words, 31, 22, 23, 24), factor, DTYPE)
    elif Q == 1:
        lo = _code_value(_code(words, 12, 3, 4, 5), factor, DTYPE)
        hi = _code_value(_code(words, 28, 19, 20, 21), factor, DTYPE)
    elif Q == 2:
        lo = _code_value(_code(words, 9, 0, 1, 2), factor, DTYPE)
        hi = _code_value(_code(words, 25, 16, 17, 18), factor, DTYPE)
    else:
        lo = _code_value(_code(words, 14, 10, 11, 13), factor, DTYPE)
        hi = _code_value(_code(words, 30, 26, 27, 29), factor, DTYPE)
    return lo, hi


@triton.jit
def _assemble(l0, h0, l1, h1, l2, h2, l3, h3):
    """Eight ``[R, G, 4]`` tensors (pair q, lane p of word t) to ``[R, 32 G]`` by
    ``k = 32 g + 8 q + 2 t + p``."""
    e = tl.join(
        tl.join(tl.join(l0, h0), tl.join(l2, h2)),
        tl.join(tl.join(l1, h1), tl.join(l3, h3)),
    )  # [R, G, 4 (t), 2 (p), 2 (q // 2), 2 (q % 2)]
    e = tl.permute(e, (0, 1, 4, 5, 2, 3))  # [R, G, q // 2, q % 2, t, p]
    return tl.reshape(e, (e.shape[0], 32 * e.shape[1]))


@triton.jit
def fragment_operand(words, scales, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """Words ``[R, G, 4]`` (int32) and their rows' scales ``[R, G, 1]`` (uint8) to the
    ``[R, 32 G]`` values in ``DTYPE``: row ``r``'s K range ``32 G`` of the step."""
    if FAST:
        tl.static_assert(DTYPE.is_bf16(), "the fast MXFP4 decoder makes bfloat16")
        factors = scales.to(tl.int32) * 0x800080 + 0x3F003F00  # bf16 2**(s-1), twice
        p0, p1, p2, p3 = _fast_pairs(words, tl.broadcast_to(factors, words.shape))
        l0, h0 = _bf16_halves(p0)
        l1, h1 = _bf16_halves(p1)
        l2, h2 = _bf16_halves(p2)
        l3, h3 = _bf16_halves(p3)
    else:
        factor = ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        l0, h0 = _generic_pair(words, factor, 0, DTYPE)
        l1, h1 = _generic_pair(words, factor, 1, DTYPE)
        l2, h2 = _generic_pair(words, factor, 2, DTYPE)
        l3, h3 = _generic_pair(words, factor, 3, DTYPE)
    return _assemble(l0, h0, l1, h1, l2, h2, l3, h3)


@triton.jit
def fragment_tile(
    w_ptr, s_ptr, rows, k0, k, stride_wc, stride_sc, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr
):
    """Words ``[R, G, 4]`` (int32) and scales ``[R, G, 1]`` (uint8) of ``rows`` for the K step
    of ``BLOCK_K`` values at ``k0`` (a multiple of 128), in the layout ``fragment_operand`` takes.

    ``rows`` must be in range (no row mask).  ``MASK_K``: the step may reach past
    ``k``, where a short last chunk stores its rows ``4 n`` words apart (``n``
    groups) and the scale chunks end.  ``stride_wc``: bytes a whole chunk of
    words (``[N, 64]``); ``stride_sc``: bytes a scale chunk (``[N, 4]``).
    """
    G: tl.constexpr = BLOCK_K // 32
    C: tl.constexpr = G // 4  # chunks a step
    R: tl.constexpr = rows.shape[0]
    j = tl.arange(0, 16 * C)  # the step's words in storage order: chunk, lane t, group
    i = tl.arange(0, 4 * C)  # its scale bytes: chunk, group
    chunk = k0 // 128 + j // 16
    words_ptr = w_ptr.to(tl.pointer_type(tl.int32)) + (chunk * (stride_wc // 4))[None, :]
    scale_ptr = s_ptr + (k0 // 128 + i // 4)[None, :] * stride_sc + rows[:, None] * 4
    scale_ptr += (i % 4)[None, :]
    if MASK_K:
        left = k // 32 - 4 * chunk  # groups from word j's chunk on
        n = tl.minimum(left, 4)  # groups in that chunk (<= 0: past the end)
        gi = j % 4
        offset = rows[:, None] * (4 * n)[None, :] + ((j // 4 % 4) * n + gi)[None, :]
        words = tl.load(words_ptr + offset, mask=(gi < n)[None, :], other=0)
        scale_ok = 4 * (k0 // 128 + i // 4) < k // 32  # the scale's chunk holds a group
        scales = tl.load(scale_ptr, mask=scale_ok[None, :], other=127)
    else:
        words = tl.load(words_ptr + rows[:, None] * 16 + (j % 16)[None, :])
        scales = tl.load(scale_ptr)
    words = tl.permute(tl.reshape(words, (R, C, 4, 4)), (0, 1, 3, 2))  # [R, chunk, group, t]
    return tl.reshape(words, (R, G, 4)), tl.reshape(scales, (R, G, 1))


@triton.jit
def _decode_kernel(
    w_ptr, s_ptr, out_ptr, k, stride_wc, stride_sc, FAST: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: ``ROWS`` rows by one ``BLOCK_K`` step of a fragment matrix, decoded."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k0 = tl.program_id(1) * BLOCK_K
    words, scales = fragment_tile(w_ptr, s_ptr, r, k0, k, stride_wc, stride_sc, BLOCK_K, True)
    values = fragment_operand(words, scales, out_ptr.dtype.element_ty, FAST)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r[:, None] * k + kk[None, :], values, mask=kk[None, :] < k)


def decode_fragment(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *, fast: bool
) -> torch.Tensor:
    """A fragment matrix ``blocks [N, K/2]``, ``scales [scale_chunks(K), N, 4]`` to ``[N, K]``
    values by the kernels' decoder (for tests: the plain path decodes in torch)."""
    n, k = blocks.shape[0], blocks.shape[1] * 2
    rows = 16
    if n % rows:
        raise ValueError(f"rows ({n}) must be a multiple of {rows}")
    out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    block_k = 128
    scales = scales.contiguous()
    grid = (n // rows, triton.cdiv(k, block_k))
    _decode_kernel[grid](
        blocks.contiguous(), scales, out, k, n * 64, scales.stride(0),
        FAST=fast, ROWS=rows, BLOCK_K=block_k,
    )  # fmt: skip
    return out
