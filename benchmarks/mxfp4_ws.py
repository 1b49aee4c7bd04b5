"""gpt-oss's MXFP4 expert GEMMs as warp-specialized Gluon kernels, against the Triton ones.

    PYTHONPATH=. python3 benchmarks/mxfp4_ws.py [--tokens 128,256] [--block-m 32,64]

The engine's MXFP4 GEMMs (``_down_fragment_kernel`` and its gate/up twin in
``moetrace/kernels/triton_moe.py``) run each K step as one chain in every
warp: copy, wait, decode, multiply.  This is the design that profile pointed
to, built in Gluon (Triton 3.6's explicit-layout language) to measure it
before any engine code depends on it: one warp only copies, by the
tensor-memory accelerator, into a ring of stages guarded by mbarriers; the
warpgroup only decodes (the engine's own ``fragment_operand``, called from
Gluon, on the same fragment layout) and multiplies, the weights as the left operand straight from its
registers (``wgmma`` RS), the tokens as the right from shared memory.

For each ``--tokens`` T (a decode batch, top-4 routing at random over
gpt-oss-20b's 32 experts, 2,880 x 2,880) and each ``--block-m`` it times
both GEMMs, as CUDA-graph replays chained in steady state
(``graph_replay.chained_us``): the Triton kernel at its default tile; this
kernel, checked bit for bit against it; and two ablations of this kernel,
the copies alone (the warpgroup waits for each stage and releases it) and
the products alone (decode and multiply on whatever the ring holds, no
copies, no waits).  The gate/up kernel here takes the tokens already in the
blocks' row order (the engine's gathers them itself), so the gather is
timed on its own.  docs/benchmarks.md has the figures and what they say.
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import graph_replay
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from moetrace.kernels import triton_moe as tm
from moetrace.kernels.triton_align import align_routing_torch
from moetrace.kernels.triton_mxfp4 import fragment_operand
from moetrace.kernels.triton_rounding import round_to_bf16

STEP = gl.constexpr(128)  # K values a stage (one chunk of the fragment layout)
COPIES_ONLY = gl.constexpr(1)  # ablations (see the module doc)
PRODUCTS_ONLY = gl.constexpr(2)
HALF = gl.constexpr(64)  # K values a product (a 128-byte swizzled box of bf16)
LINE = gl.constexpr(256)  # elements a line of the words' and scales' copies (see _words_descs)


@constexpr_function
def _mma_layout(num_warps, block_m):
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16]
    )


@constexpr_function
def _rows(num_warps):
    """Weight rows a program: 32 a warp (each warpgroup two 64-row products)."""
    return 32 * num_warps


@constexpr_function
def _row_bases(num_warps: int) -> tuple[list[int], list[int]]:
    """Rows of a program's 128 in the product's layout: lanes hold rows 1, 2, 4 (with the
    quad's lane ``t``), a register row 8, warps 16 each, further registers the rest."""
    warps = [16 << i for i in range(int(math.log2(num_warps)))]
    regs = [8]
    row = 16 * num_warps
    while row < _rows(num_warps):
        regs.append(row)
        row *= 2
    return regs, warps


@constexpr_function
def _word_layout(num_warps, groups):
    """``[ROWS, groups, 4]`` int32 words: lane ``4 r + t`` holds word ``t`` of its rows,
    every group in registers (the product's left operand, a word per 32 values)."""
    reg_rows, warp_rows = _row_bases(num_warps)
    regs = [[0, 1 << i, 0] for i in range(int(math.log2(groups)))] + [[r, 0, 0] for r in reg_rows]
    lanes = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warps = [[r, 0, 0] for r in warp_rows]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [_rows(num_warps), groups, 4])


@constexpr_function
def _chunk_layout(num_warps):
    """A stage's words as stored, ``[ROWS, 16]`` (word ``4 t + j``): what ``_word_layout``
    holds, lane ``t``'s four words of a row one 16-byte shared load."""
    reg_rows, warp_rows = _row_bases(num_warps)
    regs = [[0, 1], [0, 2]] + [[r, 0] for r in reg_rows]
    lanes = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(
        regs, lanes, [[r, 0] for r in warp_rows], [], [_rows(num_warps), 16]
    )


@constexpr_function
def _tail_layout(num_warps):
    """The short last chunk's words as stored, two rows of 8 to a line: ``[ROWS // 2, 16]``,
    row ``r``'s word ``2 t + j`` at ``(r // 2, 8 (r % 2) + 2 t + j)``."""
    reg_rows, warp_rows = _row_bases(num_warps)

    def at(row):
        return [0, 8] if row == 1 else [row // 2, 0]

    regs = [[0, 1]] + [at(r) for r in reg_rows]
    lanes = [[0, 2], [0, 4], at(1), at(2), at(4)]
    return gl.DistributedLinearLayout(
        regs, lanes, [at(r) for r in warp_rows], [], [_rows(num_warps) // 2, 16]
    )


@constexpr_function
def _scale_layout(num_warps):
    """A stage's scales as copied, four rows of 4 to a line: ``[ROWS // 4, 16]``, row ``r``'s
    group ``j`` at ``(r // 4, 4 (r % 4) + j)``; the quad's lanes share them."""
    reg_rows, warp_rows = _row_bases(num_warps)

    def at(row):
        return [0, 4 * row] if row < 4 else [row // 4, 0]

    regs = [[0, 1], [0, 2]] + [at(r) for r in reg_rows]
    lanes = [[0, 0], [0, 0], at(1), at(2), at(4)]
    return gl.DistributedLinearLayout(
        regs, lanes, [at(r) for r in warp_rows], [], [_rows(num_warps) // 4, 16]
    )


@gluon.jit
def _loader(
    w_desc, wt_desc, s_desc, x_desc, ready, empty, words_s, tail_s, scales_s, x_s,
    word_line, tail_line, scale_line, x_row, chunk_lines, scale_chunk_lines, num_full,
    STAGES: gl.constexpr, ABLATE: gl.constexpr,
):  # fmt: skip
    """The copy warp: each K chunk's words, scales and token values, then the short last
    chunk, into a ring of ``STAGES``.  Its fence after each wait orders the warpgroup's
    shared loads of a released stage before the copies that overwrite it."""
    if ABLATE != PRODUCTS_ONLY:
        chunk_bytes: gl.constexpr = (
            w_desc.block_type.nbytes + s_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes
        )
        for c in range(num_full):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            fence_async_shared()
            bar = ready.index(s)
            mbarrier.expect(bar, chunk_bytes)
            tma.async_copy_global_to_shared(
                w_desc, [word_line + c * chunk_lines, 0], bar, words_s.index(s)
            )
            tma.async_copy_global_to_shared(
                s_desc, [scale_line + c * scale_chunk_lines, 0], bar, scales_s.index(s)
            )
            tma.async_copy_global_to_shared(x_desc, [x_row, c * STEP], bar, x_s.index(2 * s))
            tma.async_copy_global_to_shared(
                x_desc, [x_row, c * STEP + HALF], bar, x_s.index(2 * s + 1)
            )
        s = num_full % STAGES
        mbarrier.wait(empty.index(s), ((num_full // STAGES) & 1) ^ 1)
        fence_async_shared()
        bar = ready.index(s)
        tail_bytes: gl.constexpr = (
            wt_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
        )
        mbarrier.expect(bar, tail_bytes)
        tma.async_copy_global_to_shared(wt_desc, [tail_line, 0], bar, tail_s)
        tma.async_copy_global_to_shared(
            s_desc, [scale_line + num_full * scale_chunk_lines, 0], bar, scales_s.index(s)
        )
        tma.async_copy_global_to_shared(x_desc, [x_row, num_full * STEP], bar, x_s.index(2 * s))


@gluon.jit
def _stage_words(words_smem, num_warps: gl.constexpr):
    """A full stage's words as two halves of 64 values, ``[R, 2, 4]`` each."""
    ROWS: gl.constexpr = _rows(num_warps)
    line_rows = words_smem._reinterpret(gl.int32, [ROWS, 16], words_smem.layout)
    words = line_rows.load(_chunk_layout(num_warps))
    words = gl.permute(gl.reshape(words, [ROWS, 4, 2, 2]), (0, 3, 1, 2))  # [R, j_lo, t, j_hi]
    return gl.split(words)


@gluon.jit
def _stage_scales(scales_smem, num_warps: gl.constexpr):
    """A stage's scales as two halves of 64 values, ``[R, 2]`` each."""
    ROWS: gl.constexpr = _rows(num_warps)
    scale_rows = scales_smem._reinterpret(gl.uint8, [ROWS // 4, 16], scales_smem.layout)
    scales = gl.reshape(scale_rows.load(_scale_layout(num_warps)), [ROWS, 2, 2])
    return gl.split(gl.permute(scales, (0, 2, 1)))  # [R, j_lo]


@gluon.jit
def _half_product(acc, words, scales, x_smem, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """``acc + w @ x.T`` for one 64-value half of a stage: ``words [R, 2, 4]``, ``scales [R, 2]``."""
    mma: gl.constexpr = _mma_layout(num_warps, BLOCK_M)
    wl: gl.constexpr = _word_layout(num_warps, 2)
    words = gl.convert_layout(words, wl, assert_trivial=True)
    scales = gl.convert_layout(scales, gl.SliceLayout(2, wl), assert_trivial=True)
    a = gl.convert_layout(
        fragment_operand(words, gl.expand_dims(scales, 2), gl.bfloat16, True),
        gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
    )
    return warpgroup_mma(a, x_smem.permute([1, 0]), acc, is_async=True)


@gluon.jit
def _tile_product(
    ready, empty, words_s, tail_s, scales_s, x_s, num_full,
    N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr, ABLATE: gl.constexpr,
):  # fmt: skip
    """``w[rows] @ x[tokens].T``, ``[ROWS, N]``: each chunk decoded and multiplied while
    the chunk before finishes its products, whose stage is then released."""
    ROWS: gl.constexpr = _rows(num_warps)
    SYNC: gl.constexpr = ABLATE != PRODUCTS_ONLY
    mma: gl.constexpr = _mma_layout(num_warps, N)
    acc = gl.zeros([ROWS, N], gl.float32, layout=mma)
    for c in range(num_full):
        s = c % STAGES
        if SYNC:
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        if ABLATE != COPIES_ONLY:
            w0, w1 = _stage_words(words_s.index(s), num_warps)
            s0, s1 = _stage_scales(scales_s.index(s), num_warps)
            acc = _half_product(acc, w0, s0, x_s.index(2 * s), N, num_warps)
            acc = _half_product(acc, w1, s1, x_s.index(2 * s + 1), N, num_warps)
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
        if SYNC:
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=c > 0)
    s = num_full % STAGES
    if SYNC:
        mbarrier.wait(ready.index(s), (num_full // STAGES) & 1)
    if ABLATE != COPIES_ONLY:
        tail = tail_s._reinterpret(gl.int32, [ROWS // 2, 16], tail_s.layout).load(
            _tail_layout(num_warps)
        )
        words = gl.permute(gl.reshape(tail, [ROWS, 4, 2]), (0, 2, 1))
        s0, _ = _stage_scales(scales_s.index(s), num_warps)
        acc = _half_product(acc, words, s0, x_s.index(2 * s), N, num_warps)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc


@gluon.jit
def _down_epilogue(
    acc, y_ptr, b_ptr, topk_weights_ptr, sorted_pair_ids_ptr, expert, pid_m, n0, num_pairs, hidden,
    stride_yt, stride_be, BLOCK_M: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """``y[pair] = weight[pair] * (acc + b2[e])`` for the tile's channels and pairs."""
    ROWS: gl.constexpr = _rows(num_warps)
    N: gl.constexpr = acc.shape[1]
    mma: gl.constexpr = _mma_layout(num_warps, N)
    tok_rows = pid_m * BLOCK_M + gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    pair = gl.load(sorted_pair_ids_ptr + tok_rows)
    row_ok = pair < num_pairs
    channels = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    ch_ok = channels < hidden
    weight = gl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(gl.float32)
    if HAS_BIAS:
        bias = gl.load(b_ptr + expert * stride_be + channels, mask=ch_ok, other=0.0).to(gl.float32)
        acc = round_to_bf16(round_to_bf16(acc) + gl.expand_dims(bias, 1))
    acc = acc * gl.expand_dims(weight, 0)
    ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_yt, 0) + gl.expand_dims(channels, 1)
    gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(row_ok, 0) & gl.expand_dims(ch_ok, 1))


@gluon.jit
def _gate_up_epilogue(
    acc, h_ptr, b_ptr, sorted_pair_ids_ptr, expert, pid_m, n0, num_pairs, inter, stride_ht, stride_be,
    swiglu_alpha, swiglu_limit, BLOCK_M: gl.constexpr, HAS_BIAS: gl.constexpr,
):  # fmt: skip
    """``h[row] = swiglu(acc_gate + b_gate, acc_up + b_up)`` for the tile's channels, rounded
    after each op as the reference's bf16 tensors are (the engine kernel's epilogue)."""
    N: gl.constexpr = acc.shape[1]
    CH: gl.constexpr = acc.shape[0] // 2  # each 16 rows: 8 channels' gate rows, then their up rows
    acc = gl.permute(gl.reshape(acc, [CH // 8, 2, 8, N]), (0, 2, 3, 1))
    acc_g, acc_u = gl.split(acc)
    acc_g = gl.reshape(acc_g, [CH, N])
    acc_u = gl.reshape(acc_u, [CH, N])
    layout: gl.constexpr = acc_g.type.layout
    channels = n0 // 2 + gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
    ch_ok = channels < inter
    rows = pid_m * BLOCK_M + gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    row_ok = gl.load(sorted_pair_ids_ptr + rows) < num_pairs
    bias_g = 0.0
    bias_u = 0.0
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + channels
        bias_g = gl.expand_dims(gl.load(b_ptrs, mask=ch_ok, other=0.0).to(gl.float32), 1)
        bias_u = gl.expand_dims(gl.load(b_ptrs + inter, mask=ch_ok, other=0.0).to(gl.float32), 1)
    out = tm._gated_activation(
        acc_g, acc_u, bias_g, bias_u, swiglu_alpha, swiglu_limit, gl.bfloat16, "clamped_swiglu",
        HAS_BIAS,
    )  # fmt: skip
    ptrs = h_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ht, 0) + gl.expand_dims(channels, 1)
    gl.store(ptrs, out.to(gl.bfloat16), mask=gl.expand_dims(row_ok, 0) & gl.expand_dims(ch_ok, 1))


@gluon.jit
def _compute(
    ready, empty, words_s, tail_s, scales_s, x_s, num_full,
    out_ptr, b_ptr, topk_weights_ptr, sorted_pair_ids_ptr, expert, pid_m, n0, num_pairs, channels,
    stride_out, stride_be, swiglu_alpha, swiglu_limit,
    GATE_UP: gl.constexpr, BLOCK_M: gl.constexpr, HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, ABLATE: gl.constexpr,
):  # fmt: skip
    """The warpgroup: the tile's products, then its outputs."""
    acc = _tile_product(
        ready, empty, words_s, tail_s, scales_s, x_s, num_full,
        BLOCK_M, STAGES, num_warps, ABLATE,
    )  # fmt: skip
    if GATE_UP:
        _gate_up_epilogue(
            acc, out_ptr, b_ptr, sorted_pair_ids_ptr, expert, pid_m, n0, num_pairs, channels,
            stride_out, stride_be, swiglu_alpha, swiglu_limit, BLOCK_M, HAS_BIAS,
        )  # fmt: skip
    else:
        _down_epilogue(
            acc, out_ptr, b_ptr, topk_weights_ptr, sorted_pair_ids_ptr, expert, pid_m, n0, num_pairs,
            channels, stride_out, stride_be, BLOCK_M, HAS_BIAS, num_warps,
        )  # fmt: skip


@gluon.jit
def _experts_kernel(
    w_desc, wt_desc, s_desc, x_desc,
    out_ptr, b_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr, num_rows_padded_ptr,
    num_pairs, num_m_blocks, n_rows, k, expert_word_lines, expert_scale_lines, stride_out, stride_be,
    swiglu_alpha, swiglu_limit,
    GATE_UP: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, ABLATE: gl.constexpr = 0,
):  # fmt: skip
    """One GEMM of a layer's experts for 32 weight rows a warp of one row block:
    ``GATE_UP``: ``h[row] = swiglu(w13[e] @ xs[row] + b13[e])`` (``xs``: the tokens in the
    blocks' row order); else ``y[pair] = weight[pair] * (w2[e] @ h[row] + b2[e])``."""
    ROWS: gl.constexpr = _rows(num_warps)
    pid_m, pid_n = tm._tile_ids(gl.program_id(0), num_m_blocks, gl.cdiv(n_rows, ROWS), GROUP_M)
    if pid_m * BLOCK_M < gl.load(num_rows_padded_ptr):
        expert = gl.load(block_expert_ids_ptr + pid_m)
        n0 = pid_n * ROWS
        num_full = k // STEP
        words_s = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS // 16, LINE], w_desc.layout)
        tail_s = gl.allocate_shared_memory(gl.int32, [ROWS // 32, LINE], wt_desc.layout)
        scales_s = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS // 64, LINE], s_desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_M, HALF], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        word_line = expert * expert_word_lines + n0 // 16
        scale_line = expert * expert_scale_lines + n0 // 64
        tail_line = expert * expert_word_lines + num_full * (n_rows // 16) + n0 // 32
        channels = n_rows // 2 if GATE_UP else n_rows
        gl.warp_specialize(
            [
                (
                    _compute,
                    (
                        ready, empty, words_s, tail_s, scales_s, x_s, num_full,
                        out_ptr, b_ptr, topk_weights_ptr, sorted_pair_ids_ptr, expert, pid_m, n0,
                        num_pairs, channels, stride_out, stride_be, swiglu_alpha, swiglu_limit,
                        GATE_UP, BLOCK_M, HAS_BIAS, STAGES, num_warps, ABLATE,
                    ),
                ),
                (
                    _loader,
                    (
                        w_desc, wt_desc, s_desc, x_desc, ready, empty, words_s, tail_s, scales_s, x_s,
                        word_line, tail_line, scale_line, pid_m * BLOCK_M, n_rows // 16, n_rows // 64,
                        num_full, STAGES, ABLATE,
                    ),
                ),
            ],
            [1],
            [40],
        )  # fmt: skip


def _words_descs(w: torch.Tensor, rows: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """A fragment matrix's words as lines of 256 int32.

    A K step of ``rows`` weight rows is one contiguous block (``rows * 64`` bytes;
    the short last chunk's, ``rows * 32``), so each is copied as a few 1 KB lines:
    the accelerator issues a request a box row, and 64-byte rows (the rows of the
    layout) cost it 16 times the requests for the same bytes.
    """
    lines = w.view(torch.int32).reshape(-1, LINE.value)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    full = TensorDescriptor(
        lines, list(lines.shape), list(lines.stride()), [rows // 16, LINE.value], layout
    )
    tail = TensorDescriptor(
        lines, list(lines.shape), list(lines.stride()), [rows // 32, LINE.value], layout
    )
    return full, tail


def _scales_desc(scales: torch.Tensor, rows: int) -> TensorDescriptor:
    """Scales ``[E, C, N, 4]`` as lines of 256 bytes (a step's ``rows`` rows: ``rows / 64``)."""
    lines = scales.reshape(-1, LINE.value)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    return TensorDescriptor(
        lines, list(lines.shape), list(lines.stride()), [rows // 64, LINE.value], layout
    )


def _tokens_desc(x: torch.Tensor, block_m: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([block_m, HALF.value], gl.bfloat16)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, HALF.value], layout)


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    routing,
    topk_weights: torch.Tensor | None,
    num_pairs: int,
    *,
    gate_up: bool,
    swiglu: tuple[float, float] = (1.702, 7.0),
    stages: int = 4,
    group_m: int = 8,
    num_warps: int = 4,
    maxnreg: int = 128,
    ablate: int = 0,
) -> None:
    """One of the two GEMMs over the rows of a sorted-layout ``AlignedRouting``; ``x`` in
    the blocks' row order.  ``maxnreg`` 128 leaves two programs a multiprocessor (the copy
    warp's warpgroup takes 40 registers a thread, the decoding one 232)."""
    num_experts, n_rows, half_k = w.shape
    k = 2 * half_k
    if k % STEP.value != HALF.value or n_rows % 64:
        raise ValueError(
            f"unsupported shape: N {n_rows}, K {k} (K must be 64 past a multiple of 128)"
        )
    rows = 32 * num_warps
    w_desc, wt_desc = _words_descs(w, rows)
    num_m_blocks = routing.num_blocks
    _experts_kernel[(num_m_blocks * triton.cdiv(n_rows, rows),)](
        w_desc, wt_desc, _scales_desc(scales, rows), _tokens_desc(x, routing.block_m),
        out, w if bias is None else bias, out if topk_weights is None else topk_weights,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_rows_padded,
        num_pairs, num_m_blocks, n_rows, k,
        n_rows * half_k // 1024, scales.stride(0) // LINE.value, out.stride(0),
        0 if bias is None else bias.stride(0), swiglu[0], swiglu[1],
        GATE_UP=gate_up, BLOCK_M=routing.block_m, GROUP_M=group_m, HAS_BIAS=bias is not None,
        STAGES=stages, num_warps=num_warps, ABLATE=ablate, maxnreg=maxnreg,
    )  # fmt: skip


def down(h, w2, s2, b2, topk_weights, routing, y, **options) -> None:
    """``y[pair] = weight * (w2[e] @ h[row] + b2[e])``."""
    _launch(h, w2, s2, b2, y, routing, topk_weights, y.shape[0], gate_up=False, **options)


def gate_up(xs, w13, s13, b13, routing, h, num_pairs, **options) -> None:
    """``h[row] = swiglu(w13[e] @ xs[row] + b13[e])`` (``xs``: the tokens gathered into the
    blocks' row order)."""
    _launch(xs, w13, s13, b13, h, routing, None, num_pairs, gate_up=True, **options)


def triton_down(h, w2, s2, b2, topk_weights, routing, y) -> None:
    """The engine's kernel on the same operands, at its default decode tile."""
    num_experts, hidden, half_k = w2.shape
    blocks = routing.num_blocks
    tm._down_fragment_kernel[(blocks * triton.cdiv(hidden, 128),)](
        h, w2, y, b2, s2, topk_weights, routing.sorted_pair_ids, routing.block_expert_ids,
        routing.num_rows_padded, *routing.table_args, y.shape[0], blocks, hidden, 2 * half_k,
        h.stride(0), w2.stride(0), hidden * 64, y.stride(0), b2.stride(0), s2.stride(0), s2.stride(1),
        HAS_BIAS=True, FAST=True, PRECISION="tf32", BLOCK_M=routing.block_m, BLOCK_N=128, BLOCK_K=128,
        GROUP_M=8, EVEN_K=False, FULL_STEP=True, PAIR_TABLE=False, num_warps=4, num_stages=3,
    )  # fmt: skip


def triton_gate_up(x, w13, s13, b13, routing, h, num_pairs) -> None:
    """The engine's gate/up kernel (it gathers the tokens itself), default decode tile."""
    num_experts, n_rows, half_k = w13.shape
    blocks = routing.num_blocks
    inter = n_rows // 2
    tm._gate_up_fragment_kernel[(blocks * triton.cdiv(inter, 64),)](
        x, w13, h, b13, s13, routing.sorted_pair_ids, routing.block_expert_ids,
        routing.num_rows_padded, *routing.table_args, num_pairs, blocks, 2 * half_k, inter,
        x.stride(0), w13.stride(0), n_rows * 64, h.stride(0), b13.stride(0), s13.stride(0), s13.stride(1),
        1.702, 7.0, TOP_K=num_pairs // x.shape[0], ACTIVATION="clamped_swiglu", HAS_BIAS=True,
        FAST=True, PRECISION="tf32", BLOCK_M=routing.block_m, BLOCK_N=64, BLOCK_K=128, GROUP_M=8,
        EVEN_K=False, FULL_STEP=True, PAIR_TABLE=False, num_warps=4, num_stages=3,
    )  # fmt: skip


def _mxfp4(experts: int, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random fragment-layout words, scales near 2**0 and bf16 biases for ``rows x k`` experts."""
    words = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(
        118, 128, (experts, k // 128 + 1, rows, 4), dtype=torch.uint8, device="cuda"
    )
    bias = (torch.randn(experts, rows, device="cuda") * 0.1).to(torch.bfloat16)
    return words, scales, bias


def _compare(out: torch.Tensor, ref: torch.Tensor) -> str:
    return "bit for bit" if torch.equal(out, ref) else f"{(out != ref).float().mean():.2%} differ"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,256", help="decode batches")
    parser.add_argument("--block-m", default="32,64", help="token rows a block (the product's N)")
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    experts, hidden, inter, top_k = 32, 2880, 2880, 4  # gpt-oss-20b
    w13, s13, b13 = _mxfp4(experts, 2 * inter, hidden)
    w2, s2, b2 = _mxfp4(experts, hidden, inter)
    opts = dict(stages=args.stages)
    print("| GEMM | T | block | Triton | Gluon | equal | copies alone | products alone |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        probs = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1)
        topk_w, topk_ids = torch.topk(probs, top_k)
        topk_w = topk_w.to(torch.bfloat16).contiguous()
        pairs = tokens * top_k
        for block_m in (int(b) for b in args.block_m.split(",")):
            routing = align_routing_torch(topk_ids.to(torch.int32), experts, block_m)
            rows = routing.sorted_pair_ids.numel()
            pair = routing.sorted_pair_ids.long()
            token_of_row = torch.where(pair < pairs, pair // top_k, 0)
            xs = x[token_of_row]  # the tokens in row order
            h_ref = torch.zeros(rows, inter, dtype=torch.bfloat16, device="cuda")
            h = torch.zeros_like(h_ref)
            y_ref = torch.zeros(pairs, hidden, dtype=torch.bfloat16, device="cuda")
            y = torch.zeros_like(y_ref)
            cases = {
                "gate/up": (
                    partial(triton_gate_up, x, w13, s13, b13, routing, h_ref, pairs),
                    partial(gate_up, xs, w13, s13, b13, routing, h, pairs),
                    h, h_ref,
                ),
                "down": (
                    partial(triton_down, h_ref, w2, s2, b2, topk_w, routing, y_ref),
                    partial(down, h_ref, w2, s2, b2, topk_w, routing, y),
                    y, y_ref,
                ),
            }  # fmt: skip
            for name, (reference, gluon_gemm, out, ref) in cases.items():
                reference()
                gluon_gemm(**opts)
                equal = _compare(out, ref)
                times = [graph_replay.chained_us([reference])]
                for ablate in (0, COPIES_ONLY.value, PRODUCTS_ONLY.value):
                    times.append(
                        graph_replay.chained_us([partial(gluon_gemm, ablate=ablate, **opts)])
                    )
                t_ref, t_full, t_copies, t_products = times
                print(
                    f"| {name} | {tokens} | {block_m} | {t_ref:.1f} µs | {t_full:.1f} µs | {equal} "
                    f"| {t_copies:.1f} µs | {t_products:.1f} µs |",
                    flush=True,
                )
            gather = graph_replay.chained_us([partial(torch.index_select, x, 0, token_of_row)])
            print(
                f"|  gather of the tokens into row order (torch) | {tokens} | {block_m} | | {gather:.1f} µs | | | |"
            )


if __name__ == "__main__":
    main()
