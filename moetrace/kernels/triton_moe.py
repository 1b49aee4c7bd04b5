"""Fused MoE experts on CUDA: Triton grouped GEMMs, and a ``grouped_mm`` alternative.

Layout (fixed by the model layers): ``w13 [E, 2I, H]`` holds the gate
projection in rows ``[:I]`` and the up projection in rows ``[I:]``;
``w2 [E, H, I]`` is the down projection.  For token t,

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (act(w13[e, :I] @ x) * (w13[e, I:] @ x)),
    e = topk_ids[t, k].

Triton path: the T*k (token, expert) pairs are grouped by expert into groups
padded to the GEMM's BLOCK_M (two small Triton kernels, sizes bounded statically
by ``T*k + min(E, T*k) * (BLOCK_M - 1)``, so no host sync and CUDA-graph safe);
then one kernel does gate/up GEMM with the activation in its epilogue (the
2I-wide intermediate never reaches memory), and a second does the down GEMM,
scales by the routing weight and writes each pair's row; a sum over k ends it
(or the residual add that follows does, ``kernels/triton_residual.py``).

``grouped_mm`` path: the same sort, a gather of the hidden rows, two
``torch.nn.functional.grouped_mm`` calls with int32 cumulative offsets, and a
scatter back.  ``moe_forward`` picks between them by T (measured, see there:
Triton won everywhere on the H200).
"""

from __future__ import annotations

import os
import warnings
from functools import partial
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moetrace.kernels.mxfp4_layout import LAYOUTS, scale_shape
from moetrace.kernels.side_streams import EXPERT_STREAMS, run_beside, run_in_parts
from moetrace.kernels.triton_align import AlignedRouting, align_routing
from moetrace.kernels.triton_mxfp4 import fragment_operand, fragment_tile
from moetrace.kernels.triton_rounding import round_to

ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------
# Triton grouped GEMMs
# ---------------------------------------------------------------------------


@triton.jit
def _tile_ids(pid, num_m_blocks, num_n_tiles, GROUP_M: tl.constexpr):
    """Swizzle so that GROUP_M row blocks walk the N tiles together (weight reuse in L2)."""
    width = GROUP_M * num_n_tiles
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _block_pairs(
    pid_m,
    sorted_pair_ids_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_pairs,
    BLOCK_M: tl.constexpr,
    PAIR_TABLE: tl.constexpr,
):
    """The pair in each row of row block ``pid_m`` (``num_pairs``: padding), in either of
    ``AlignedRouting``'s layouts (``PAIR_TABLE``: the table)."""
    offs = tl.arange(0, BLOCK_M)
    if PAIR_TABLE:
        first = tl.load(block_slots_ptr + pid_m)
        used = tl.load(block_rows_ptr + pid_m)
        pair = tl.load(sorted_pair_ids_ptr + first + offs, mask=offs < used, other=num_pairs)
    else:
        pair = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + offs)
    return pair


@triton.jit
def _mxfp4_values(blocks, scales, DTYPE: tl.constexpr):
    """MXFP4 ``blocks [BK/2, BN]`` (uint8, two e2m1 codes a byte, low nibble first along K)
    and e8m0 ``scales [BN, BK/32]`` to ``[BK, BN]`` values in ``DTYPE``, exactly.

    An e2m1 code placed in float16's sign, exponent and top mantissa bits reads
    as its value times 2**-14 (code 1, 0.5, lands on a subnormal, which the
    widening to float32 keeps), so the block scale ``2**(s - 127)`` becomes a
    multiply by ``2**(s - 113)``, built from its bits.  Scales above 240
    (values past 2**113) are not supported; checkpoints stay far below.
    """
    b = blocks.to(tl.int32)
    pairs = tl.join(b & 0xF, b >> 4)  # [BK/2, BN, 2]: low nibble is the earlier k
    codes = tl.reshape(tl.permute(pairs, (0, 2, 1)), (2 * blocks.shape[0], blocks.shape[1]))
    half = ((codes & 7) << 9) | ((codes & 8) << 12)
    v = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    factor = ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # [BN, BK/32]
    groups = tl.reshape(v, (blocks.shape[0] // 16, 32, blocks.shape[1]))
    v = groups * tl.trans(factor)[:, None, :]
    return tl.reshape(v, (2 * blocks.shape[0], blocks.shape[1])).to(DTYPE)


@triton.jit
def _weight_dot(
    acc,
    a,
    w_ptrs,
    w_mask,
    s_ptrs,
    s_mask,
    MXFP4: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    A_FORMAT: tl.constexpr,
):
    """``acc + a @ w`` for one K step; MXFP4 weights are decoded in registers.

    ``MX_NATIVE``: Triton's ``dot_scaled`` (its compiler's e2m1 conversion, or
    the hardware's); else ``_mxfp4_values`` (the interpreter has no
    ``dot_scaled``).
    """
    # One return at the end: the compiler builds every statement after a constexpr
    # branch's early return too (the interpreter does not), and the 16-bit dot
    # does not type-check on MXFP4 pointers.
    if MXFP4:
        blocks = tl.load(w_ptrs, mask=w_mask, other=0)
        scales = tl.load(s_ptrs, mask=s_mask, other=127)
        if MX_NATIVE:
            acc = tl.dot_scaled(a, None, A_FORMAT, blocks, scales, "e2m1", acc)
        else:
            acc = tl.dot(a, _mxfp4_values(blocks, scales, a.dtype), acc)
    else:
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
    return acc


@triton.jit
def _gated_activation(
    acc_g,
    acc_u,
    bias_g,
    bias_u,
    swiglu_alpha,
    swiglu_limit,
    out_dtype: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The gate/up epilogue in float32: biases (broadcastable to the tiles), then the activation.

    As the reference: each product rounded to the model dtype, then its bias
    added (and rounded); the clamped SwiGLU rounds after each of its ops.
    """
    if HAS_BIAS:
        acc_g = round_to(round_to(acc_g, out_dtype) + bias_g, out_dtype)
        acc_u = round_to(round_to(acc_u, out_dtype) + bias_u, out_dtype)
    elif ACTIVATION == "clamped_swiglu":
        acc_g = round_to(acc_g, out_dtype)
        acc_u = round_to(acc_u, out_dtype)
    if ACTIVATION == "silu":
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    elif ACTIVATION == "gelu_tanh":
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh via exp
        inner = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
        out = acc_g * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner))) * acc_u
    else:  # clamped_swiglu (gpt-oss), each op rounded as the reference's 16-bit tensors are
        g = tl.minimum(acc_g, swiglu_limit)
        u = tl.minimum(tl.maximum(acc_u, -swiglu_limit), swiglu_limit)
        sig = round_to(tl.sigmoid(round_to(g * swiglu_alpha, out_dtype)), out_dtype)
        glu = round_to(g * sig, out_dtype)
        out = round_to(u + 1.0, out_dtype) * glu
    return out


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    b_ptr,
    s_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_rows_padded_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_pairs,
    num_m_blocks,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    stride_be,
    stride_se,
    stride_sn,
    swiglu_alpha,
    swiglu_limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    MXFP4: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    A_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PAIR_TABLE: tl.constexpr,
    BLOCK_PARTS: tl.constexpr = 1,
    PART: tl.constexpr = 0,
):
    """h[row] = act(x[tok] @ w_gate[e].T) * (x[tok] @ w_up[e].T) for one row block, N tile.

    Gate row ``n`` of ``w`` is ``n`` and up row ``inter + n``, or with
    ``INTERLEAVED`` (gpt-oss checkpoints) ``2n`` and ``2n + 1``.  MXFP4 weights
    are bytes (two values each) with a scale per 32 values along K.

    ``BLOCK_PARTS``/``PART``: this launch takes row blocks ``PART``, ``PART +
    BLOCK_PARTS``, ... (``num_m_blocks`` of them), so the parts of one call can
    run side by side (``kernels/side_streams.py``); likewise in the other GEMMs.
    """
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    pid_m = pid_m * BLOCK_PARTS + PART
    if pid_m * BLOCK_M >= tl.load(num_rows_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = _block_pairs(
        pid_m, sorted_pair_ids_ptr, block_slots_ptr, block_rows_ptr, num_pairs, BLOCK_M, PAIR_TABLE
    )
    row_ok = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    if INTERLEAVED:
        gate_rows = 2 * offs_n.to(tl.int64)
        up_shift = 1
    else:
        gate_rows = offs_n.to(tl.int64)
        up_shift = inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    # Weight tile read as [BLOCK_K, BLOCK_N] (MXFP4: [BLOCK_K / 2, BLOCK_N] bytes).
    W_STEP: tl.constexpr = BLOCK_K // (1 + MXFP4)  # MXFP4: two values a byte
    offs_w = tl.arange(0, W_STEP)
    wg_ptrs = w_ptr + expert * stride_we + gate_rows[None, :] * stride_wn + offs_w[:, None]
    wu_ptrs = wg_ptrs + up_shift * stride_wn
    offs_s = tl.arange(0, BLOCK_K // 32)
    sg_ptrs = s_ptr + expert * stride_se + gate_rows[:, None] * stride_sn + offs_s[None, :]
    su_ptrs = sg_ptrs + up_shift * stride_sn

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(hidden, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w_mask = n_ok[None, :]
            s_mask = n_ok[:, None]
        else:
            left = hidden - k0 * BLOCK_K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < left), other=0.0)
            w_left = left // (1 + MXFP4)
            w_mask = n_ok[None, :] & (offs_w[:, None] < w_left)
            s_mask = n_ok[:, None] & (offs_s[None, :] < left // 32)
        acc_g = _weight_dot(acc_g, a, wg_ptrs, w_mask, sg_ptrs, s_mask, MXFP4, MX_NATIVE, A_FORMAT)
        acc_u = _weight_dot(acc_u, a, wu_ptrs, w_mask, su_ptrs, s_mask, MXFP4, MX_NATIVE, A_FORMAT)
        x_ptrs += BLOCK_K
        wg_ptrs += W_STEP
        wu_ptrs += W_STEP
        sg_ptrs += BLOCK_K // 32
        su_ptrs += BLOCK_K // 32

    out_dtype: tl.constexpr = h_ptr.dtype.element_ty
    bias_g = 0.0
    bias_u = 0.0
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + offs_n
        bias_g = tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        bias_u = tl.load(b_ptrs + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _gated_activation(
        acc_g, acc_u, bias_g, bias_u, swiglu_alpha, swiglu_limit, out_dtype, ACTIVATION, HAS_BIAS
    )
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + offs_n[None, :]
    tl.store(h_ptrs, out.to(out_dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    b_ptr,
    s_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_rows_padded_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_pairs,
    num_m_blocks,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wn,
    stride_yt,
    stride_be,
    stride_se,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    A_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PAIR_TABLE: tl.constexpr,
    BLOCK_PARTS: tl.constexpr = 1,
    PART: tl.constexpr = 0,
):
    """y[pair] = weight[pair] * h[row] @ w2[e].T for one row block, N tile of `hidden`."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    pid_m = pid_m * BLOCK_PARTS + PART
    if pid_m * BLOCK_M >= tl.load(num_rows_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = _block_pairs(
        pid_m, sorted_pair_ids_ptr, block_slots_ptr, block_rows_ptr, num_pairs, BLOCK_M, PAIR_TABLE
    )
    row_ok = pair < num_pairs

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    W_STEP: tl.constexpr = BLOCK_K // (1 + MXFP4)  # MXFP4: two values a byte
    offs_w = tl.arange(0, W_STEP)
    offs_s = tl.arange(0, BLOCK_K // 32)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_w[:, None]
    s_ptrs = s_ptr + expert * stride_se + offs_n[:, None].to(tl.int64) * stride_sn + offs_s[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(inter, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w_mask = n_ok[None, :]
            s_mask = n_ok[:, None]
        else:
            left = inter - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < left), other=0.0)
            w_left = left // (1 + MXFP4)
            w_mask = n_ok[None, :] & (offs_w[:, None] < w_left)
            s_mask = n_ok[:, None] & (offs_s[None, :] < left // 32)
        acc = _weight_dot(acc, a, w_ptrs, w_mask, s_ptrs, s_mask, MXFP4, MX_NATIVE, A_FORMAT)
        a_ptrs += BLOCK_K
        w_ptrs += W_STEP
        s_ptrs += BLOCK_K // 32

    # 16-bit routing weights widen exactly here: no float32 copy of them is made first.
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    out_dtype: tl.constexpr = y_ptr.dtype.element_ty
    if HAS_BIAS:
        # As the reference: product rounded, bias added and rounded, then weighted.
        bias = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc = round_to(round_to(acc, out_dtype) + bias[None, :], out_dtype)
    acc = acc * weight[:, None]
    y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(out_dtype), mask=row_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------
# MXFP4 in the fragment layout (kernels/mxfp4_layout.py): weights as the left operand
# ---------------------------------------------------------------------------


@triton.jit
def _fragment_step(
    acc,
    w_ptr,
    s_ptr,
    b_ptrs,
    w_rows,
    b_ok,
    k0,
    k,
    stride_wc,
    stride_sc,
    FAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MASK_K: tl.constexpr,
):
    """``acc + w[w_rows, k0:k0+BLOCK_K] @ b`` for a fragment-layout MXFP4 ``w``.

    ``w_rows`` are in range (a tile's rows past the matrix repeat its last row:
    no masks, so no selects after the loads; their outputs are not stored).
    ``b_ptrs`` point at the ``[BLOCK_K, BLOCK_M]`` right operand (activations,
    transposed) for ``k0 = 0``; ``b_ok`` masks its columns.  ``MASK_K``: the
    step reaches past ``k`` (the tail).
    """
    words, scales = fragment_tile(
        w_ptr, s_ptr, w_rows, k0, k, stride_wc, stride_sc, BLOCK_K, MASK_K
    )
    offs_k = tl.arange(0, BLOCK_K)
    if MASK_K:
        b_mask = b_ok[None, :] & (offs_k[:, None] < k - k0)
    else:
        b_mask = b_ok[None, :]
    b = tl.load(b_ptrs + k0, mask=b_mask, other=0.0)
    a = fragment_operand(words, scales, b.dtype, FAST)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_fragment_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    b_ptr,
    s_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_rows_padded_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_pairs,
    num_m_blocks,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wc,
    stride_ht,
    stride_be,
    stride_se,
    stride_sc,
    swiglu_alpha,
    swiglu_limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FULL_STEP: tl.constexpr = False,
    PAIR_TABLE: tl.constexpr = False,
    BLOCK_PARTS: tl.constexpr = 1,
    PART: tl.constexpr = 0,
):
    """``h[row] = act(gate) * up`` for BLOCK_N channels, the weights as the left operand.

    The tile ``acc [2 BLOCK_N, BLOCK_M]`` is ``w13[e, rows] @ x[tokens].T``: its
    rows are the fragment rows of the channels (8 gate rows, then their 8 up
    rows), so the split into gate and up is a register split.
    """
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    pid_m = pid_m * BLOCK_PARTS + PART
    if pid_m * BLOCK_M >= tl.load(num_rows_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = _block_pairs(
        pid_m, sorted_pair_ids_ptr, block_slots_ptr, block_rows_ptr, num_pairs, BLOCK_M, PAIR_TABLE
    )
    row_ok = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)

    w_rows = tl.minimum(2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N), 2 * inter - 1)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    x_ptrs = x_ptr + tok[None, :] * stride_xt + tl.arange(0, BLOCK_K)[:, None]  # x.T
    acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_full = hidden // BLOCK_K * BLOCK_K
    if FULL_STEP:
        tl.assume(k_full >= BLOCK_K)  # see _down_fragment_kernel
    for k0 in range(0, k_full, BLOCK_K):
        acc = _fragment_step(
            acc, w_base, s_base, x_ptrs, w_rows, row_ok, k0, hidden, stride_wc, stride_sc,
            FAST, PRECISION, BLOCK_K, False,
        )  # fmt: skip
    if not EVEN_K:
        acc = _fragment_step(
            acc, w_base, s_base, x_ptrs, w_rows, row_ok, k_full, hidden, stride_wc, stride_sc,
            FAST, PRECISION, BLOCK_K, True,
        )  # fmt: skip

    # [blocks of 8 channels, gate/up, 8, BLOCK_M] -> gate and up tiles [BLOCK_N, BLOCK_M]
    acc = tl.permute(tl.reshape(acc, (BLOCK_N // 8, 2, 8, BLOCK_M)), (0, 2, 3, 1))
    acc_g, acc_u = tl.split(acc)
    acc_g = tl.reshape(acc_g, (BLOCK_N, BLOCK_M))
    acc_u = tl.reshape(acc_u, (BLOCK_N, BLOCK_M))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    out_dtype: tl.constexpr = h_ptr.dtype.element_ty
    bias_g = 0.0
    bias_u = 0.0
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + offs_n
        bias_g = tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        bias_u = tl.load(b_ptrs + inter, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = _gated_activation(
        acc_g, acc_u, bias_g, bias_u, swiglu_alpha, swiglu_limit, out_dtype, ACTIVATION, HAS_BIAS
    )
    h_ptrs = h_ptr + rows[None, :].to(tl.int64) * stride_ht + offs_n[:, None]
    tl.store(h_ptrs, out.to(out_dtype), mask=row_ok[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_fragment_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    b_ptr,
    s_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_rows_padded_ptr,
    block_slots_ptr,
    block_rows_ptr,
    num_pairs,
    num_m_blocks,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wc,
    stride_yt,
    stride_be,
    stride_se,
    stride_sc,
    HAS_BIAS: tl.constexpr,
    FAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FULL_STEP: tl.constexpr = False,
    PAIR_TABLE: tl.constexpr = False,
    BLOCK_PARTS: tl.constexpr = 1,
    PART: tl.constexpr = 0,
):
    """``y[pair] = weight[pair] * w2[e] @ h[row]`` for BLOCK_N channels of ``hidden``,
    as ``acc [BLOCK_N, BLOCK_M] = w2[e, channels] @ h[rows].T``."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    pid_m = pid_m * BLOCK_PARTS + PART
    if pid_m * BLOCK_M >= tl.load(num_rows_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = _block_pairs(
        pid_m, sorted_pair_ids_ptr, block_slots_ptr, block_rows_ptr, num_pairs, BLOCK_M, PAIR_TABLE
    )
    row_ok = pair < num_pairs

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    w_rows = tl.minimum(offs_n, hidden - 1)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    h_rows = h_ptr + rows[None, :].to(tl.int64) * stride_ht + tl.arange(0, BLOCK_K)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_full = inter // BLOCK_K * BLOCK_K
    if FULL_STEP:
        # With a path that skips the K loop, the accumulator reaching the loop's end may
        # come from a plain move, and ptxas then waits for every tensor-core product before
        # the next is issued (its note C7515): no decoding overlaps a product.  Known to
        # run the loop at least once, the products stay in flight, up to 7 groups.
        tl.assume(k_full >= BLOCK_K)
    for k0 in range(0, k_full, BLOCK_K):
        acc = _fragment_step(
            acc, w_base, s_base, h_rows, w_rows, row_ok, k0, inter, stride_wc, stride_sc,
            FAST, PRECISION, BLOCK_K, False,
        )  # fmt: skip
    if not EVEN_K:
        acc = _fragment_step(
            acc, w_base, s_base, h_rows, w_rows, row_ok, k_full, inter, stride_wc, stride_sc,
            FAST, PRECISION, BLOCK_K, True,
        )  # fmt: skip

    # 16-bit routing weights widen exactly here: no float32 copy of them is made first.
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    out_dtype: tl.constexpr = y_ptr.dtype.element_ty
    if HAS_BIAS:
        # As the reference: product rounded, bias added and rounded, then weighted.
        bias = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc = round_to(round_to(acc, out_dtype) + bias[:, None], out_dtype)
    acc = acc * weight[None, :]
    y_ptrs = y_ptr + pair[None, :].to(tl.int64) * stride_yt + offs_n[:, None]
    tl.store(y_ptrs, acc.to(out_dtype), mask=row_ok[None, :] & n_ok[:, None])


class MoEConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    mxfp4_native: bool = True  # MXFP4 decoded by tl.dot_scaled (else the kernel's bit decoder)
    maxnreg: int | None = None  # a register cap, for more resident programs (None: ptxas's)
    # Experts of more than block_m rows in blocks of this many, GEMMs of their own beside
    # the others' (routings the fused kernel groups; None: one kind of block).
    loaded_block_m: int | None = None


def _launch_options(cfg: MoEConfig) -> dict:
    """The compile options a config sets: warps, pipeline stages and any register cap."""
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg is not None:
        options["maxnreg"] = cfg.maxnreg
    return options


def moe_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    *,
    mxfp4: bool = False,
    layout: str = "checkpoint",
) -> MoEConfig:
    """Tile config by the mean rows per expert (H200, ``benchmarks/moe_tiles.py``).

    Few rows per expert (decode): the GEMMs stream weights.  Up to 16 rows,
    32-row blocks with 128-wide K steps (Qwen3 T=256, graph replay: 321 us vs
    343 for 16-row blocks); up to ~160, 64x64 tiles, 3 stages (OLMoE 233 us,
    DeepSeek-V2-Lite 302, gpt-oss bf16 427: 0-4% under 64x128, 4 stages).
    Beyond (prefill): 128x128x64 tiles, 8 warps, launch order grouped by 16
    row blocks for L2 reuse: 417 / 470 TFLOP/s at T=8192 (Qwen3 / OLMoE).

    MXFP4 in the checkpoint layout (gpt-oss-20b, the decoding in registers
    bounds it, not HBM): at decode the kernel's bit decoder on 64x128 tiles
    (583 us at T=256) beats ``tl.dot_scaled`` on any tile of the sweep (657 us
    at best); at prefill ``tl.dot_scaled`` on 128x64 tiles, 4 warps (5.74 ms at
    T=8192 vs 6.93 on the dense prefill tile).

    MXFP4 in the fragment layout (``layout="fragment"``, what ``MoEExperts``
    keeps unless ``MOETRACE_MXFP4_LAYOUT=checkpoint``): ``block_n`` counts weight
    rows (gate/up: half as many channels), ``block_k`` a multiple of 128 (one
    aligned copy of a row's scales).  ``FRAGMENT_DECODE``/``FRAGMENT_PREFILL``
    are the H200 sweep's best (``benchmarks/moe_tiles.py``): 32 tokens x 128
    rows x 128, 4 warps, 3 stages at T=256 (364 us when chosen, 1.60x the bit
    decoder's best, 582 us; 251 us with chunk-major words, where 4 stages,
    K steps of 256 and 64-token blocks stay as fast or slower); 128 x 128 x
    128, 4 warps at T=8192, 4.62 ms (1.25x ``tl.dot_scaled``'s best, 5.76 ms).
    From 32 rows an expert, routings the fused kernel groups give the experts
    of more than 32 pairs 64-row blocks and GEMMs of their own beside the
    others', 4 stages (``FRAGMENT_DECODE_LOADED``; one layer at T=256, the two
    kinds side by side: 229.6 us against 244.3 in one kind; at T=128-192 one
    kind is faster).
    """
    rows_per_expert = num_tokens * top_k / num_experts
    if mxfp4 and layout == "fragment":
        if rows_per_expert > 160:
            return FRAGMENT_PREFILL
        return FRAGMENT_DECODE_LOADED if rows_per_expert >= 32 else FRAGMENT_DECODE
    if mxfp4:
        if rows_per_expert <= 160:
            return MoEConfig(64, 128, 64, 8, 4, 4, mxfp4_native=False)
        return MoEConfig(128, 64, 64, 8, 4, 3)
    if rows_per_expert <= 16:
        return MoEConfig(32, 64, 128, 8, 4, 3)
    if rows_per_expert <= 160:
        return MoEConfig(64, 64, 64, 8, 4, 3)
    return MoEConfig(128, 128, 64, 16, 8, 3)


# Fragment-layout MXFP4 tiles (``moe_config``): decode steps (up to 160 rows an expert), prefill.
FRAGMENT_DECODE = MoEConfig(32, 128, 128, 8, 4, 3, mxfp4_native=False)
# From 32 rows an expert on (gpt-oss-20b at 256 tokens) many experts pass 32 pairs: those
# take 64-row blocks of their own, each weight decoded once, beside the others, both kinds
# with 4 stages.  Below that too few experts pass 32 for their GEMM to keep pace beside
# the rest's: one layer's experts at T=192, 204 us in one kind against 218 in two
# (``benchmarks/moe_tiles.py``, docs/benchmarks.md).
FRAGMENT_DECODE_LOADED = FRAGMENT_DECODE._replace(num_stages=4, loaded_block_m=64)
FRAGMENT_PREFILL = MoEConfig(128, 128, 128, 8, 4, 3, mxfp4_native=False)


class ExpertExtras(NamedTuple):
    """What gpt-oss's experts add to plain ``w13``/``w2``: biases, MXFP4, a clamped SwiGLU.

    With ``w13_scale``/``w2_scale`` the weights are MXFP4 as checkpoints store
    them: ``w13 [E, 2I, H/2]`` and ``w2 [E, H, I/2]`` uint8 (two e2m1 values a
    byte, low nibble first) with e8m0 scales ``[E, 2I, H/32]`` and
    ``[E, H, I/32]``, decoded inside the GEMMs' K loops.  ``interleaved``: the
    rows of ``w13`` alternate gate and up (gpt-oss's layout).  Biases ``b13
    [E, 2I]`` (gate then up) and ``b2 [E, H]`` are added as the reference adds
    them: after the product is rounded to the model dtype, before the routing
    weight.  ``swiglu_*`` parametrise the ``clamped_swiglu`` activation.

    ``mxfp4_layout="fragment"``: the MXFP4 bytes and scales are laid out as
    ``kernels/mxfp4_layout.py`` describes (scales ``[E, scale_chunks(K), N, 4]``;
    ``w13``'s rows in blocks of 8 gate then 8 up rows); ``mxfp4_wide_scales``:
    some scale exceeds the fast decoder's 128, so the exact generic one serves.
    """

    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    interleaved: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4_layout: str = "checkpoint"
    mxfp4_wide_scales: bool = False


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    capture: torch.Tensor | None = None,
    extras: ExpertExtras | None = None,
    capture_weights: torch.Tensor | None = None,
    aligned: AlignedRouting | None = None,
    weights_f32: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """Routed experts' output ``[T, H]`` through two Triton grouped GEMMs (see module doc).

    ``capture`` (``capture_weights``): a ``[T, k]`` view of the routing capture
    buffer the ids (the weights) are also written to.  ``aligned``/``weights_f32``
    and ``combine``: see ``fused_moe_with_config``.
    """
    num_tokens, top_k = topk_ids.shape
    mxfp4 = extras is not None and extras.w13_scale is not None
    layout = extras.mxfp4_layout if mxfp4 else "checkpoint"
    cfg = moe_config(num_tokens, top_k, w13.shape[0], mxfp4=mxfp4, layout=layout)
    return fused_moe_with_config(
        hidden,
        w13,
        w2,
        topk_weights,
        topk_ids,
        cfg,
        activation,
        capture=capture,
        capture_weights=capture_weights,
        extras=extras,
        aligned=aligned,
        weights_f32=weights_f32,
        combine=combine,
    )


# Devices where ``tl.dot_scaled`` failed to compile: MXFP4 falls back to the bit decoder there.
_DOT_SCALED_FAILED: set[torch.device] = set()


def _mxfp4_native(device: torch.device) -> bool:
    """Whether ``tl.dot_scaled`` decodes MXFP4 here (not in the interpreter, which lacks it)."""
    return device.type == "cuda" and device not in _DOT_SCALED_FAILED


def fused_moe_with_config(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    cfg: MoEConfig,
    activation: str = "silu",
    *,
    capture: torch.Tensor | None = None,
    extras: ExpertExtras | None = None,
    mxfp4_native: bool | None = None,
    capture_weights: torch.Tensor | None = None,
    aligned: AlignedRouting | None = None,
    weights_f32: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """``fused_moe`` with an explicit tile config (benchmarks sweep these).

    ``mxfp4_native`` picks how MXFP4 weights are decoded: ``tl.dot_scaled``
    (where it compiles) or the kernel's own bit arithmetic (``False``); by
    default the config's choice.  ``aligned`` and ``weights_f32``: the pairs
    already grouped for ``cfg.block_m`` and the weights in float32, as the
    fused routing kernels hand them over (``kernels/triton_routing.py``);
    the alignment and the weights' cast are then skipped.  ``combine=False``:
    the pairs' rows ``[T, k, H]`` come back un-summed, for the residual add
    to sum (``kernels/triton_residual.py``).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; have {ACTIVATIONS}")
    if not _use_triton(hidden):
        raise RuntimeError("fused_moe needs CUDA tensors (or TRITON_INTERPRET=1)")
    extras = extras or ExpertExtras()
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    mxfp4 = extras.w13_scale is not None
    fragment = mxfp4 and extras.mxfp4_layout == "fragment"
    if mxfp4:
        layout = extras.mxfp4_layout
        _check_mxfp4(w13, extras.w13_scale, (num_experts, 2 * inter, hidden_size), cfg, layout)
        _check_mxfp4(w2, extras.w2_scale, (num_experts, hidden_size, inter), cfg, layout)
    if num_tokens == 0:
        return hidden.new_empty((0, hidden_size))
    hidden = hidden.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    # Unused pointers get a real tensor, never read (their constexpr switch is off).
    b13 = w13 if extras.b13 is None else extras.b13.contiguous()
    b2 = w2 if extras.b2 is None else extras.b2.contiguous()
    s13 = w13 if extras.w13_scale is None else extras.w13_scale.contiguous()
    s2 = w2 if extras.w2_scale is None else extras.w2_scale.contiguous()
    if mxfp4_native is None and not cfg.mxfp4_native:
        mxfp4_native = False
    if mxfp4 and not fragment and mxfp4_native is None and _mxfp4_native(hidden.device):
        try:
            return fused_moe_with_config(
                hidden, w13, w2, topk_weights, topk_ids, cfg, activation,
                capture=capture, capture_weights=capture_weights, extras=extras,
                mxfp4_native=True, aligned=aligned, weights_f32=weights_f32, combine=combine,
            )  # fmt: skip
        except Exception as exc:  # a compile failure: Triton raises several types
            if torch.cuda.is_current_stream_capturing():
                raise
            _DOT_SCALED_FAILED.add(hidden.device)
            warnings.warn(
                f"tl.dot_scaled did not compile here ({type(exc).__name__}: {str(exc)[:200]}); "
                "MXFP4 experts use the kernel's own decoder",
                stacklevel=2,
            )
    native = bool(mxfp4 and mxfp4_native)
    a_format = "bf16" if hidden.dtype == torch.bfloat16 else "fp16"

    if aligned is None:
        routing = align_routing(
            topk_ids,
            num_experts,
            cfg.block_m,
            capture,
            topk_weights=topk_weights,
            capture_weights=capture_weights,
        )
        weights = topk_weights.reshape(-1)  # the down GEMM widens them as it loads them
    else:
        if aligned.block_m != cfg.block_m or weights_f32 is None:
            raise ValueError(
                f"routing aligned for {aligned.block_m}-row blocks (float32 weights "
                f"{'missing' if weights_f32 is None else 'given'}); the tiles take {cfg.block_m}"
            )
        if capture is not None or capture_weights is not None:
            raise ValueError("prepared routing was captured by the router's kernel already")
        if aligned.loaded is not None and not fragment:
            raise ValueError("loaded experts' blocks are read by the MXFP4 fragment GEMMs only")
        routing = aligned
        weights = weights_f32.reshape(-1)
    num_m_blocks = routing.num_blocks
    h = hidden.new_empty((num_m_blocks * cfg.block_m, inter))
    y = hidden.new_empty((num_pairs, hidden_size))
    if fragment:
        _fragment_gemms(hidden, w13, w2, h, y, weights, routing, cfg, activation, extras)
        return _pair_rows_out(y, num_tokens, top_k, combine)

    def launch(part: int, parts: int) -> None:
        blocks = _part_blocks(num_m_blocks, part, parts)
        # The pairs' grouping and the sizes, as both kernels take them.
        grouped = (
            routing.sorted_pair_ids,
            routing.block_expert_ids,
            routing.num_rows_padded,
            *routing.table_args,
            num_pairs,
            blocks,
            hidden_size,
            inter,
        )
        common = dict(
            MXFP4=mxfp4,
            MX_NATIVE=native,
            A_FORMAT=a_format,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            PAIR_TABLE=routing.is_table,
            BLOCK_PARTS=parts,
            PART=part,
            **_launch_options(cfg),
        )
        grid1 = (blocks * triton.cdiv(inter, cfg.block_n),)
        _gate_up_kernel[grid1](
            hidden,
            w13,
            h,
            b13,
            s13,
            *grouped,
            hidden.stride(0),
            w13.stride(0),
            w13.stride(1),
            h.stride(0),
            b13.stride(0),
            s13.stride(0),
            s13.stride(1),
            extras.swiglu_alpha,
            extras.swiglu_limit,
            TOP_K=top_k,
            ACTIVATION=activation,
            HAS_BIAS=extras.b13 is not None,
            INTERLEAVED=extras.interleaved,
            EVEN_K=hidden_size % cfg.block_k == 0,
            **common,
        )
        grid2 = (blocks * triton.cdiv(hidden_size, cfg.block_n),)
        _down_kernel[grid2](
            h,
            w2,
            y,
            b2,
            s2,
            weights,
            *grouped,
            h.stride(0),
            w2.stride(0),
            w2.stride(1),
            y.stride(0),
            b2.stride(0),
            s2.stride(0),
            s2.stride(1),
            HAS_BIAS=extras.b2 is not None,
            EVEN_K=inter % cfg.block_k == 0,
            **common,
        )

    parts = expert_parts(num_tokens * top_k / num_experts, num_m_blocks)
    run_in_parts(launch, parts, hidden.device)
    return _pair_rows_out(y, num_tokens, top_k, combine)


# The MXFP4 fragment GEMMs in one part: split in two they took longer (one layer's
# experts at T=256, four layers chained on the H200: 270.6 us in one part, 279.2 in
# two; ``python benchmarks/steady_state.py streams``).  Split by expert instead, so that
# an expert's two row blocks run together, they gained 3 us chained but the decode step
# lost 0.24 ms (docs/benchmarks.md).  What does gain is two kinds of block, each with
# its tile (``FRAGMENT_DECODE_LOADED``): gpt-oss-20b's decode step 9.23 -> 8.71 ms.
FRAGMENT_STREAMS = 1


def expert_parts(rows_per_expert: float, num_m_blocks: int, streams: int | None = None) -> int:
    """How many side-by-side parts the experts' GEMMs run in (``kernels/side_streams.py``).

    Decode-sized steps only (the tiles' 160 rows an expert): there each GEMM is
    short and its fill and drain are a large share of it, and a second part
    recovers some (four layers' experts chained at T=256 on the H200, one part
    against two: OLMoE-1B-7B 216.2 -> 208.7 us a layer, Qwen3-30B-A3B 300.4 ->
    297.4, DeepSeek-V2-Lite 286.0 -> 281.9; three parts gained no more).
    Prefill GEMMs run many waves, where the boundaries cost little.
    """
    streams = EXPERT_STREAMS if streams is None else streams
    if rows_per_expert > 160 or num_m_blocks < streams:
        return 1
    return streams


def _part_blocks(num_m_blocks: int, part: int, parts: int) -> int:
    """Row blocks ``part``, ``part + parts``, ... below ``num_m_blocks``: how many one part's
    launch takes (its kernels' ``BLOCK_PARTS``/``PART``)."""
    return triton.cdiv(num_m_blocks - part, parts)


def _pair_rows_out(y: torch.Tensor, num_tokens: int, top_k: int, combine: bool) -> torch.Tensor:
    """The down GEMM's pair rows ``[T k, H]`` as ``fused_moe`` returns them: summed over
    k to ``[T, H]``, or (``combine=False``) un-summed ``[T, k, H]``."""
    rows = y.view(num_tokens, top_k, y.shape[-1])
    if not combine:
        return rows
    return y if top_k == 1 else rows.sum(dim=1)


def _check_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor | None,
    shape: tuple[int, int, int],
    cfg: MoEConfig,
    layout: str,
) -> None:
    """MXFP4 ``blocks [E, N, K/2]`` uint8 with scales for a dense ``[E, N, K]``: ``[E, N, K/32]``,
    or in the fragment layout ``[E, scale_chunks(K), N, 4]``."""
    e, n, k = shape
    if layout not in LAYOUTS:
        raise ValueError(f"unknown MXFP4 layout {layout!r}; have {LAYOUTS}")
    if k % 32 or cfg.block_k % 32:
        raise ValueError(f"MXFP4 needs K ({k}) and the K tile ({cfg.block_k}) in multiples of 32")
    if layout == "fragment" and (cfg.block_k % 128 or cfg.block_n % 16):
        raise ValueError(
            f"fragment MXFP4 tiles need block_k in multiples of 128 ({cfg.block_k}) and block_n "
            f"in multiples of 16 ({cfg.block_n})"
        )
    if scales is None or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("MXFP4 weights need uint8 blocks and uint8 scales")
    want = (e, n, k // 32) if layout == "checkpoint" else (e, *scale_shape(n, k))
    if tuple(blocks.shape) != (e, n, k // 2) or tuple(scales.shape) != want:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} / scales {list(scales.shape)} do not fit "
            f"[{e}, {n}, {k}] weights in the {layout} layout"
        )


def _fragment_gemms(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    routing: AlignedRouting,
    cfg: MoEConfig,
    activation: str,
    extras: ExpertExtras,
) -> None:
    """The two GEMMs on fragment-layout MXFP4 weights: ``h`` from ``hidden``, then ``y``."""
    num_tokens, hidden_size = hidden.shape
    num_pairs = y.shape[0]
    inter = h.shape[1]
    s13, s2 = extras.w13_scale.contiguous(), extras.w2_scale.contiguous()
    b13 = w13 if extras.b13 is None else extras.b13.contiguous()
    b2 = w2 if extras.b2 is None else extras.b2.contiguous()
    fast = hidden.is_cuda and hidden.dtype == torch.bfloat16 and not extras.mxfp4_wide_scales
    num_m_blocks = routing.num_blocks
    common = dict(
        FAST=fast,
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",  # float32: exact products
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        PAIR_TABLE=routing.is_table,
        **_launch_options(cfg),
    )
    channels = cfg.block_n // 2  # gate and up rows of each channel

    def launch(routing: AlignedRouting, h: torch.Tensor, part: int, parts: int) -> None:
        blocks = _part_blocks(routing.num_blocks, part, parts)
        kind = dict(common, BLOCK_M=routing.block_m)
        _gate_up_fragment_kernel[(blocks * triton.cdiv(inter, channels),)](
            hidden, w13, h, b13, s13,
            routing.sorted_pair_ids, routing.block_expert_ids, routing.num_rows_padded, *routing.table_args,
            num_pairs, blocks, hidden_size, inter,
            hidden.stride(0), w13.stride(0), w13.shape[1] * 64, h.stride(0), b13.stride(0),
            s13.stride(0), s13.stride(1),
            extras.swiglu_alpha, extras.swiglu_limit,
            TOP_K=num_pairs // num_tokens, ACTIVATION=activation, HAS_BIAS=extras.b13 is not None,
            BLOCK_N=channels, EVEN_K=hidden_size % cfg.block_k == 0,
            FULL_STEP=hidden_size >= cfg.block_k, BLOCK_PARTS=parts, PART=part, **kind,
        )  # fmt: skip
        _down_fragment_kernel[(blocks * triton.cdiv(hidden_size, cfg.block_n),)](
            h, w2, y, b2, s2, weights,
            routing.sorted_pair_ids, routing.block_expert_ids, routing.num_rows_padded, *routing.table_args,
            num_pairs, blocks, hidden_size, inter,
            h.stride(0), w2.stride(0), w2.shape[1] * 64, y.stride(0), b2.stride(0),
            s2.stride(0), s2.stride(1),
            HAS_BIAS=extras.b2 is not None, BLOCK_N=cfg.block_n, EVEN_K=inter % cfg.block_k == 0,
            FULL_STEP=inter >= cfg.block_k, BLOCK_PARTS=parts, PART=part, **kind,
        )  # fmt: skip

    loaded = routing.loaded
    if loaded is not None:
        # The loaded experts' blocks decode each weight once for up to loaded.block_m
        # pairs; beside the others' on a side stream they fill the gaps those leave
        # (docs/benchmarks.md, "Tiles" and "Figures the code's choices rest on").
        h_loaded = hidden.new_empty((loaded.num_blocks * loaded.block_m, inter))
        run_beside(
            [partial(launch, routing, h, 0, 1), partial(launch, loaded, h_loaded, 0, 1)],
            hidden.device,
        )
        return
    parts = expert_parts(num_pairs / w13.shape[0], num_m_blocks, FRAGMENT_STREAMS)
    run_in_parts(partial(launch, routing, h), parts, hidden.device)


# ---------------------------------------------------------------------------
# torch grouped_mm path
# ---------------------------------------------------------------------------


def _grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    return _grouped_mm() is not None


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh")
    raise ValueError(f"unsupported activation {activation!r}; have {ACTIVATIONS}")


def moe_grouped_mm(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """Routed experts through ``grouped_mm``: sort pairs, two grouped GEMMs, scatter back.

    No host sync: offsets are an int32 device cumsum of the per-expert counts.
    """
    grouped_mm = _grouped_mm()
    if grouped_mm is None:
        raise RuntimeError("this torch has no grouped_mm")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=hidden.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    _, order = torch.sort(flat, stable=True)
    x = hidden.index_select(0, order // top_k)
    h = grouped_mm(x, w13.transpose(1, 2), offs=offs)
    a = _activate(h[:, :inter], activation) * h[:, inter:]
    y = grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    out = torch.empty_like(y)
    out.index_copy_(0, order, y)
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)


# Token counts [lo, hi) where grouped_mm beats the Triton kernels on the H200
# (bf16, torch 2.11, Triton 3.6): none measured, see moe_forward's docstring.
_GROUPED_MM_TOKEN_RANGES: tuple[tuple[int, int], ...] = ()


def moe_forward(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    capture: torch.Tensor | None = None,
    extras: ExpertExtras | None = None,
    capture_weights: torch.Tensor | None = None,
    aligned: AlignedRouting | None = None,
    weights_f32: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """Routed experts' output with the faster measured implementation for this T.

    ``aligned``/``weights_f32`` (from ``kernels/triton_routing.py``) go to the
    Triton kernels; a caller passes them only where ``uses_grouped_mm`` is false.
    ``combine=False``: the Triton kernels return the un-summed ``[T, k, H]``
    rows (``fused_moe_with_config``); ``grouped_mm`` sums them anyway.

    ``capture`` (a ``[T, k]`` view of the routing capture buffer) receives the
    ids, ``capture_weights`` (likewise) the weights.

    benchmarks/kernels.py on one H200 (bf16, random top-8 routing), Triton vs
    ``grouped_mm``, median us; "graph" = CUDA-graph replay as in decode:

        Qwen3-30B-A3B (E128 I768)   T=1 graph    40 vs 102   T=8 graph   137 vs 242
                                    T=256 graph 340 vs 524   T=1024 graph 399 vs 683
                                    T=8192     1531 vs 2464  T=16384    2948 vs 4570
        OLMoE-1B-7B (E64 I1024)     T=1 graph    49 vs 107   T=256 graph 232 vs 393
                                    T=8192     1836 vs 2730  T=16384    3505 vs 5213

    Triton won at every T tried (1 to 16384, eager and graph), so grouped_mm
    serves no range today; the table above is where to re-measure on new
    hardware or torch versions.
    """
    if aligned is None and uses_grouped_mm(hidden.shape[0], hidden.dtype, extras):
        if capture is not None:
            capture.copy_(topk_ids)
        if capture_weights is not None:
            capture_weights.copy_(topk_weights)
        return moe_grouped_mm(hidden, w13, w2, topk_weights, topk_ids, activation=activation)
    return fused_moe(
        hidden,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        capture=capture,
        extras=extras,
        capture_weights=capture_weights,
        aligned=aligned,
        weights_f32=weights_f32,
        combine=combine,
    )


def uses_grouped_mm(num_tokens: int, dtype: torch.dtype, extras: ExpertExtras | None) -> bool:
    """Whether ``moe_forward`` serves ``num_tokens`` rows through ``grouped_mm``."""
    in_range = any(lo <= num_tokens < hi for lo, hi in _GROUPED_MM_TOKEN_RANGES)
    # grouped_mm has no biases or MXFP4
    return in_range and extras is None and dtype == torch.bfloat16 and grouped_mm_available()
