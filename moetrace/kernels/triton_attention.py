"""Triton kernels for the paged KV cache: writing new K/V and attention over it.

One attention kernel serves every step kind: prefill of whole prompts, chunked
prefill, prompts whose prefix came from the cache (``q_len < seq_len``) and
decode (``q_len == 1``), all packed in one step.  A program owns one tile of
a sequence's queries and one KV head, with all the query heads that share that
KV head stacked as rows of its tile (GQA packing): each K/V tile read from the
cache serves ``group`` heads at once, which is what makes decode at large batch
memory-efficient.

A step is launched as two classes of sequences: short queries (decode) get
one 16-row tile per sequence, longer ones (prefill chunks) 64-row tiles over a
flattened tile index.  Each launch's grid depends only on the step's token and
sequence counts; a program whose sequence belongs to the other class, or whose
tile lies past its query, returns at once.  So one captured CUDA graph serves
any mix of prefill chunks and decodes of its padded shape.  Decode batches too
small to fill the GPU (sequences x KV heads < 4 x SMs) split each
single-query sequence's keys over 2 programs (flash-decoding) and merge the
partial softmaxes in a second small kernel.

Nothing here reads a device value on the host: the block tables' row stride
too is read on the device (``AttentionMetadata.block_table_stride``), so a
graph replays steps whose tables are packed at another width.

Sliding window convention (checked against transformers' ``masking_utils``:
``sliding_window_overlay`` keeps ``kv_idx > q_idx - sliding_window``): key
``j`` is visible to the query at position ``p`` iff ``j <= p`` and
``p - j < window``, so each query sees at most ``window`` keys, itself included.
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moetrace import envs
from moetrace.forward_context import AttentionMetadata
from moetrace.kernels.kv_store import store_kv_torch  # the plain path, and the baseline benchmarked
from moetrace.kernels.triton_rounding import round_to

_LOG2E = 1.4426950408889634
_LOG2E_K = tl.constexpr(_LOG2E)  # the same, for use inside kernels


def _use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under the interpreter (tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------
# KV store
# ---------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Negative slots mark padding tokens (e.g. a CUDA graph's unused rows).
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_heads) & (d[None, :] < HEAD_DIM)
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        kc = (
            k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
        )
        vc = (
            v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
        )
        tl.store(kc, k.to(kc.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new K/V (``[T, Hkv, D]``) into the paged caches at ``slot_mapping``.

    One Triton program per token; tokens with a negative slot are skipped, so a
    padded CUDA-graph batch can point its unused rows at slot -1.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if not _use_triton(key):
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    block_size = k_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_heads * head_dim >= 1024 else 2,
    )


# ---------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------


@triton.jit
def _mask_hidden(s, j, j_ok, pos, window, USE_WINDOW: tl.constexpr):
    """Scores ``s [rows, keys]`` with -inf where key ``j`` is hidden from the row at ``pos``:
    past it, out of range, or (``USE_WINDOW``) ``window`` or more positions back."""
    visible = (j[None, :] <= pos[:, None]) & j_ok[None, :]
    if USE_WINDOW:
        visible = visible & (pos[:, None] - j[None, :] < window)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _block_and_slot(j, BLOCK_SIZE: tl.constexpr):
    """Key positions ``j`` (never negative) as (their block's index in the block table,
    their slot in it): unsigned, so that a power-of-two block size divides by a shift
    and a mask, without a signed division's fix-ups for negative values."""
    u = j.to(tl.uint32)
    return (u // BLOCK_SIZE).to(tl.int32), (u % BLOCK_SIZE).to(tl.int32)


@triton.jit
def _attend(
    q,
    acc,
    m_i,
    l_i,
    lo,
    hi,
    pos,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    window,
    score_scale,
    d,
    d_ok,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EAGER_ROUNDING: tl.constexpr = False,
    PRECISE_EXP: tl.constexpr = False,
    inv_l=None,
    RECIPROCAL: tl.constexpr = False,
):
    """Online-softmax over keys [lo, hi).  MASKED=False: every key is visible to every row.

    ``score_scale`` is the softmax scale times log2(e).  ``EAGER_ROUNDING``
    (attention with sinks): ``score_scale`` is the plain softmax scale, ``m_i``
    and ``l_i`` already each row's final max and denominator (``_row_pass``),
    ``inv_l`` its ``_reciprocal``; each probability is rounded to the value
    dtype after its division, as eager attention's softmax returns it, and
    nothing rescales.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        j_ok = j < hi
        table_idx, in_blk = _block_and_slot(j, BLOCK_SIZE)
        if MASKED:
            blk = tl.load(bt_row + table_idx, mask=j_ok, other=0).to(tl.int64)
            kv_mask = j_ok[:, None] & d_ok[None, :]
        else:
            blk = tl.load(bt_row + table_idx).to(tl.int64)
            kv_mask = d_ok[None, :]
        k_off = blk * stride_kb + in_blk * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if EAGER_ROUNDING:
            s = _eager_scores(q, k, score_scale, DOT_PRECISION)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * score_scale
        if MASKED:
            s = _mask_hidden(s, j, j_ok, pos, window, USE_WINDOW)
        if EAGER_ROUNDING:
            e = _exp(round_to(s - m_i[:, None], q.dtype), PRECISE_EXP)
            p = _share(e, l_i, inv_l, RECIPROCAL, PRECISE_EXP)
        else:
            if MASKED:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # A row that has seen no visible key yet keeps m = -inf; subtract 0
                # instead so that exp2 gives 0, not NaN.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_ref = m_new
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + in_blk * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if EAGER_ROUNDING:
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence that owns flattened query tile ``tile``.

    Sequence ``b``'s tiles start at ``query_start[b] // BLOCK_Q + b``: at least
    as many tiles as all earlier sequences need, and increasing in ``b``, so the
    owner is the last ``b`` whose start is ``<= tile`` (binary search).
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= tile, mid + 1, lo)
        hi = tl.where(start <= tile, hi, mid)
    return lo - 1


@triton.jit
def _eager_scores(q, k, scale, DOT_PRECISION: tl.constexpr):
    """``q @ k.T * scale`` rounded twice to q's dtype, as eager attention's matmul and product."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return round_to(round_to(qk, q.dtype) * scale, q.dtype)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """``exp(x)`` in float32: libdevice's ``expf`` (what torch's CUDA softmax calls) when
    ``PRECISE``, else the fast ``exp2`` form (the interpreter has no libdevice)."""
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp2(x * _LOG2E_K)


@triton.jit
def _fma(x, y, z, FUSED: tl.constexpr):
    """``x * y + z`` rounded once: the GPU's FMA when ``FUSED``, else (the interpreter, whose
    numpy has none) through float64, where a product of two float32s is exact."""
    if FUSED:
        return tl.fma(x, y, z)
    else:
        return (x.to(tl.float64) * y.to(tl.float64) + z.to(tl.float64)).to(tl.float32)


@triton.jit
def _reciprocal(total, RECIPROCAL: tl.constexpr):
    """``1 / total`` rounded as IEEE division rounds it, once a row, for ``_share``
    (``total`` itself, unused, without ``RECIPROCAL``)."""
    if RECIPROCAL:
        return tl.div_rn(tl.full(total.shape, 1.0, tl.float32), total)
    else:
        return total


@triton.jit
def _share(e, total, inv, RECIPROCAL: tl.constexpr, FUSED: tl.constexpr):
    """``e / total`` (``total`` a row's sum, ``inv`` its ``_reciprocal``) rounded as IEEE
    division rounds it, as torch's softmax divides.

    ``RECIPROCAL``: ``q = e * inv`` is within an ulp of the quotient, the residual
    ``e - q * total`` is exact by the FMA, and ``q + residual * inv`` rounds to the
    quotient itself (Markstein's theorem, for a correctly rounded ``inv``; it holds while
    the residual does not underflow, so for exponentials above about 2**-100, and below
    them it is within an ulp of a weight too small to move a float32 sum).  Three
    instructions an element where the division takes a dozen and a branch to its slow
    path.
    """
    if RECIPROCAL:
        q = e * inv[:, None]
        residual = _fma(-q, total[:, None], e, FUSED)
        return _fma(residual, inv[:, None], q, FUSED)
    else:
        return tl.div_rn(e, total[:, None])


@triton.jit
def _cache_tile(
    cache_ptr, bt_row, j, j_ok, kv_head, d, d_ok, stride_b, stride_s, stride_h,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Keys ``j`` (where ``j_ok``) of one KV head from a paged cache, K's or V's:
    ``[len(j), D]``, zeros where masked."""
    table_idx, in_blk = _block_and_slot(j, BLOCK_SIZE)
    blk = tl.load(bt_row + table_idx, mask=j_ok, other=0).to(tl.int64)
    off = blk * stride_b + in_blk * stride_s + kv_head * stride_h
    return tl.load(
        cache_ptr + off[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0
    )


@triton.jit
def _key_tile_scores(
    q, j, j_ok, pos, k_cache_ptr, bt_row, kv_head, window, scale, d, d_ok, stride_kb, stride_ks,
    stride_kh, BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Keys ``j``'s eager scores from the paged K cache, hidden keys at -inf: one function
    for the passes and the scratch path, whose bits must be the same."""
    k = _cache_tile(
        k_cache_ptr, bt_row, j, j_ok, kv_head, d, d_ok, stride_kb, stride_ks, stride_kh,
        BLOCK_SIZE,
    )  # fmt: skip
    return _mask_hidden(_eager_scores(q, k, scale, DOT_PRECISION), j, j_ok, pos, window, USE_WINDOW)


@triton.jit
def _row_pass(
    q,
    m,
    lo,
    hi,
    pos,
    k_cache_ptr,
    bt_row,
    kv_head,
    window,
    scale,
    d,
    d_ok,
    stride_kb,
    stride_ks,
    stride_kh,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SUM: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
):
    """One pass over a row's visible keys in [lo, hi), eager scores recomputed from K.

    ``SUM=False``: the largest score, starting from ``m`` (the sink).
    ``SUM=True``: ``sum(exp(round(score - m)))`` with ``m`` the row's max.
    With sinks the reference rounds ``score - max`` before ``exp`` and each
    probability after dividing by the row's sum, so both must be known before
    any value is weighted: two passes over K ahead of the one over K and V
    (in decode most of the re-read comes from L2).
    """
    if SUM:
        out = tl.zeros_like(m)
    else:
        out = m
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        j_ok = j < hi
        s = _key_tile_scores(
            q, j, j_ok, pos, k_cache_ptr, bt_row, kv_head, window, scale, d, d_ok,
            stride_kb, stride_ks, stride_kh, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        if SUM:
            out = out + tl.sum(_exp(round_to(s - m[:, None], q.dtype), PRECISE_EXP), 1)
        else:
            out = tl.maximum(out, tl.max(s, 1))
    return out


@triton.jit
def _sink_tile(
    q, sink, lo, hi, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, window, scale, d, d_ok,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, ONE_TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRECISE_EXP: tl.constexpr, RECIPROCAL: tl.constexpr,
):  # fmt: skip
    """Attention with sinks when a row's visible keys [lo, hi) fit one tile of ``ONE_TILE``.

    Rounds as ``_row_pass`` and ``_attend(EAGER_ROUNDING)`` do, but the scores
    stay in registers: the row max, the sum and the probabilities come from
    one read of K, not three (a sliding-window layer's decode, whose window
    bounds its keys).  Returns the probability-weighted values.
    """
    j = lo + tl.arange(0, ONE_TILE)
    j_ok = j < hi
    table_idx, in_blk = _block_and_slot(j, BLOCK_SIZE)
    blk = tl.load(bt_row + table_idx, mask=j_ok, other=0).to(tl.int64)
    kv_mask = j_ok[:, None] & d_ok[None, :]
    k_off = blk * stride_kb + in_blk * stride_ks + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = _eager_scores(q, k, scale, DOT_PRECISION)
    s = _mask_hidden(s, j, j_ok, pos, window, USE_WINDOW)
    m = tl.maximum(sink, tl.max(s, 1))
    e = _exp(round_to(s - m[:, None], q.dtype), PRECISE_EXP)
    total = _exp(round_to(sink - m, q.dtype), PRECISE_EXP) + tl.sum(e, 1)
    p = _share(e, total, _reciprocal(total, RECIPROCAL), RECIPROCAL, PRECISE_EXP)
    v_off = blk * stride_vb + in_blk * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)


@triton.jit
def _kept(scores_row, row_ok, j, lo, hi, other: tl.constexpr):
    """What ``_scratch_passes`` keeps for keys ``j``, in float32 (``other`` from ``hi``)."""
    keep = row_ok[:, None] & (j < hi)[None, :]
    s = tl.load(scores_row[:, None] + (j - lo)[None, :], mask=keep, other=other)
    return s.to(tl.float32)


@triton.jit
def _kept_exps(scores_row, row_ok, j, lo, hi, m, dtype: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """``exp(round(score - m))`` of the scores ``_scratch_passes`` kept for keys ``j``, as
    eager attention's softmax takes them (0 from ``hi``): its sum's loop and values' loop
    compute the same."""
    s = _kept(scores_row, row_ok, j, lo, hi, float("-inf"))
    return _exp(round_to(s - m[:, None], dtype), PRECISE_EXP)


@triton.jit
def _scratch_passes(
    q, sink, lo, hi, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, window, scale, d, d_ok,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scores_row, row_ok,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PRECISE_EXP: tl.constexpr, RECIPROCAL: tl.constexpr,
    KEEP_EXPS: tl.constexpr,
):  # fmt: skip
    """Attention with sinks over a row's visible keys [lo, hi), reading K once.

    The three passes of ``_passes`` recompute each row's eager scores from K
    for the max, the sum and the values.  Here the first pass keeps them:
    each row's rounded scores go to its scratch row (``scores_row``, one per
    row of the tile, key ``j`` at ``j - lo``) while the max is taken, and the
    sum and the weighted values read them back.  The scores are already
    rounded to the model dtype, so the scratch holds them exactly, and the
    tiles, the order of every sum and every rounding are the passes': the
    result is theirs bit for bit.  ``KEEP_EXPS`` (a float32 scratch): the sum's
    pass writes each exponential over its score, so the values' pass divides
    them as they are instead of computing them again.  Returns the
    probability-weighted values.
    """
    offs_n = tl.arange(0, BLOCK_N)
    m = sink
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        j_ok = j < hi
        s = _key_tile_scores(
            q, j, j_ok, pos, k_cache_ptr, bt_row, kv_head, window, scale, d, d_ok,
            stride_kb, stride_ks, stride_kh, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        m = tl.maximum(m, tl.max(s, 1))
        keep = row_ok[:, None] & j_ok[None, :]
        tl.store(
            scores_row[:, None] + (j - lo)[None, :], s.to(scores_row.dtype.element_ty), mask=keep
        )
    tl.debug_barrier()  # every thread's scores are stored before any thread reads them back
    total = tl.zeros_like(m)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        e = _kept_exps(scores_row, row_ok, j, lo, hi, m, q.dtype, PRECISE_EXP)
        total = total + tl.sum(e, 1)
        if KEEP_EXPS:
            # Over the very scores just read, once every thread has read them: Triton may
            # lay the store out apart from the load, so other threads write them.
            tl.debug_barrier()
            keep = row_ok[:, None] & (j < hi)[None, :]
            tl.store(scores_row[:, None] + (j - lo)[None, :], e, mask=keep)
    if KEEP_EXPS:
        tl.debug_barrier()  # the exponentials are stored before any thread reads them back
    total = _exp(round_to(sink - m, q.dtype), PRECISE_EXP) + total
    inv = _reciprocal(total, RECIPROCAL)
    acc = tl.zeros([q.shape[0], q.shape[1]], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        if KEEP_EXPS:
            e = _kept(scores_row, row_ok, j, lo, hi, 0.0)
        else:
            e = _kept_exps(scores_row, row_ok, j, lo, hi, m, q.dtype, PRECISE_EXP)
        p = _share(e, total, inv, RECIPROCAL, PRECISE_EXP)
        v = _cache_tile(
            v_cache_ptr, bt_row, j, j < hi, kv_head, d, d_ok, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE,
        )  # fmt: skip
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _passes(
    q, acc, m_i, l_i, sink, row_lo, row_hi, kv_lo, kv_hi, first_pos, pos, k_cache_ptr,
    v_cache_ptr, bt_row, kv_head, window, score_scale, d, d_ok, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
    PRECISE_EXP: tl.constexpr, DECODE_CLASS: tl.constexpr, RECIPROCAL: tl.constexpr,
):  # fmt: skip
    """The key loops: with sinks, each row's max and sum first (``_row_pass``), then
    ``_attend`` over [kv_lo, kv_hi); without, ``_attend``'s online softmax alone."""
    if HAS_SINKS:
        m_i = _row_pass(
            q, sink, row_lo, row_hi, pos, k_cache_ptr, bt_row, kv_head, window, score_scale,
            d, d_ok, stride_kb, stride_ks, stride_kh,
            BLOCK_N, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION, False, PRECISE_EXP,
        )  # fmt: skip
        l_i = _exp(round_to(sink - m_i, q.dtype), PRECISE_EXP) + _row_pass(
            q, m_i, row_lo, row_hi, pos, k_cache_ptr, bt_row, kv_head, window, score_scale,
            d, d_ok, stride_kb, stride_ks, stride_kh,
            BLOCK_N, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION, True, PRECISE_EXP,
        )  # fmt: skip
    inv_l = _reciprocal(l_i, RECIPROCAL and HAS_SINKS)
    # Keys up to the tile's first query position are visible to all its rows
    # (without a window): whole BLOCK_N tiles of them skip the masking.  Not in
    # the decode class: its loop is a handful of tiles, where a second loop's
    # pipeline start and drain cost more than the masking saves.
    full_hi = kv_lo
    if not USE_WINDOW and not DECODE_CLASS:
        full = tl.maximum(tl.minimum(kv_hi, first_pos + 1) - kv_lo, 0)
        full_hi = kv_lo + full // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, kv_lo, full_hi, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head,
        window, score_scale, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, BLOCK_N, BLOCK_SIZE, False, USE_WINDOW, DOT_PRECISION, HAS_SINKS,
        PRECISE_EXP, inv_l, RECIPROCAL,
    )  # fmt: skip
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, full_hi, kv_hi, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head,
        window, score_scale, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, BLOCK_N, BLOCK_SIZE, True, USE_WINDOW, DOT_PRECISION, HAS_SINKS,
        PRECISE_EXP, inv_l, RECIPROCAL,
    )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_seqs", "decode_max_q"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scores_ptr,
    pool_ends_ptr,
    pool_size,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    bt_stride_ptr,
    num_seqs,
    decode_max_q,
    sinks_ptr,
    score_scale,
    window,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_CLASS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    HEADS_FAST: tl.constexpr = False,
    ONE_TILE: tl.constexpr = 0,
    SCORES_POOL: tl.constexpr = False,
    PACK: tl.constexpr = 1,
    RECIPROCAL: tl.constexpr = False,
    KEEP_EXPS: tl.constexpr = False,
):
    """One (query tile, KV head[, key split]) of one class of sequences.

    Decode class (``q_len <= decode_max_q``): program ``i`` is sequence ``i``'s
    single tile.  Prefill class (longer queries): program ``i`` is flattened
    tile ``i`` (see ``_find_seq``).  Programs with nothing to do return at once,
    so the grid depends on the step's padded shape alone.  ``HEADS_FAST``: the
    grid's first axis is the KV head (and split), so a sequence's heads run
    side by side and read neighbouring bytes of its cache blocks.

    ``PACK > 1`` (decode class, one query a sequence, heads contiguous in the
    cache): a program takes ``PACK`` neighbouring KV heads, their groups of
    query heads stacked as the tile's rows and their dims side by side as
    its columns (``BLOCK_D`` = ``PACK`` heads' dims).  Each row's query is
    zero outside its own KV head's columns, so one product over the packed
    columns gives every row its own head's scores (the other heads' columns
    add exact zeros), and each row stores only its own columns of the
    weighted values.  A group smaller than the tensor cores' 16 rows then
    fills them with real rows instead of padding, which halves the per-key
    work of the softmax (gpt-oss's sinks round it eagerly, at a cost).
    """
    if HEADS_FAST:
        pid = tl.program_id(1)
        head_split = tl.program_id(0)
    else:
        pid = tl.program_id(0)
        head_split = tl.program_id(1)
    kv_head = head_split // NUM_SPLITS * PACK  # the first of the program's KV heads
    split = head_split % NUM_SPLITS

    if DECODE_CLASS:
        seq = pid
        tile = 0
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
        tile = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if DECODE_CLASS:
        mine = q_len <= decode_max_q
    else:
        mine = q_len > decode_max_q
    if (not mine) or (tile * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys already in the cache before this step's queries
    stride_bt = tl.load(bt_stride_ptr).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    if PACK > 1:
        # Row r is head kv_head * GROUP + r of the one query; its KV head's dims are
        # columns from (r // GROUP) * HEAD_DIM on (HEAD_DIM a power of two here).
        q_idx = tile * BLOCK_Q + rows * 0
        head = kv_head * GROUP + rows
        row_ok = (rows < PACK * GROUP) & (q_idx < q_len)
        d_ok = d < PACK * HEAD_DIM
        own_cols = (d[None, :] // HEAD_DIM) == (rows // GROUP)[:, None]
        head_cols = d[None, :] - (rows // GROUP)[:, None] * HEAD_DIM
    else:
        # Row r is query (tile * BLOCK_Q + r // GROUP), head (kv_head * GROUP + r % GROUP).
        q_idx = tile * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        d_ok = d < HEAD_DIM
        own_cols = d_ok[None, :]
        head_cols = d[None, :]
    pos = ctx_len + q_idx

    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + head_cols,
        mask=row_ok[:, None] & own_cols,
        other=0.0,
    )

    # Keys this tile can see: up to its last query's position; with a window,
    # from its first query's oldest visible key.
    first_pos = ctx_len + tile * BLOCK_Q
    kv_hi = ctx_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
    row_lo = kv_lo
    row_hi = kv_hi
    tl.static_assert(PACK == 1 or NUM_SPLITS == 1, "packed KV heads take no key splits")
    if NUM_SPLITS > 1:
        # Flash-decoding: this program takes one contiguous share of the keys.
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, kv_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if HAS_SINKS:
        # A learned logit per head joins each row's softmax and takes no value
        # (gpt-oss).  Every split finds the whole row's max and denominator,
        # sink included, so all weight their keys by the same probabilities.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    else:
        sink = m_i  # unused
    # ONE_TILE > 0 (sinks, decode tiles, no key splits: see _launch_class): rows whose
    # visible keys fit one tile take it.  SCORES_POOL (the same, full layers too): the
    # rows of every decode sequence whose share of the scores pool ends within it
    # (pool_ends_ptr: running sums of the shares, in order) keep their scores there.
    # The others, and every row without sinks, take the passes.
    in_pool = seq < 0  # false
    if SCORES_POOL:
        pool_end = tl.load(pool_ends_ptr + seq)
        in_pool = pool_end <= pool_size
    if (row_hi - row_lo <= ONE_TILE) & (ONE_TILE > 0):
        if ONE_TILE > 0:
            acc = _sink_tile(
                q, sink, row_lo, row_hi, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, window,
                score_scale, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, ONE_TILE, BLOCK_SIZE, USE_WINDOW, DOT_PRECISION, PRECISE_EXP,
                RECIPROCAL,
            )  # fmt: skip
    elif in_pool:
        if SCORES_POOL:
            # Sequence seq's share of the pool: q_len * row_len query-keys for each of
            # num_heads heads (row_len: seq_len rounded up to POOL_ROW), after those of the
            # decode sequences before it; tile row r (query r // GROUP of this KV head's
            # GROUP heads) keeps keys [lo, hi) from r * row_len.
            row_len = (seq_len + POOL_ROW - 1) // POOL_ROW * POOL_ROW
            share = (q_len * row_len).to(tl.int64)
            base = (pool_end - share) * num_heads + kv_head * GROUP * share
            acc = _scratch_passes(
                q, sink, row_lo, row_hi, pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, window,
                score_scale, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, scores_ptr + base + rows * row_len, row_ok, BLOCK_N, BLOCK_SIZE,
                USE_WINDOW, DOT_PRECISION, PRECISE_EXP, RECIPROCAL, KEEP_EXPS,
            )  # fmt: skip
    else:
        acc, m_i, l_i = _passes(
            q, acc, m_i, l_i, sink, row_lo, row_hi, kv_lo, kv_hi, first_pos, pos,
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, window, score_scale, d, d_ok,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N,
            BLOCK_SIZE, USE_WINDOW, DOT_PRECISION, HAS_SINKS, PRECISE_EXP, DECODE_CLASS,
            RECIPROCAL,
        )  # fmt: skip
    if HAS_SINKS:
        # acc holds the probability-weighted values already: divide by 1, and
        # let the split-K merge add the shares (equal m; the first counts l = 1).
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + (split == 0).to(tl.float32)

    if NUM_SPLITS > 1:
        # Split decode has one query per sequence.  Unnormalised partials
        # [S, Hq, splits, D] and (m, l) [S, Hq, splits, 2]; _combine_kernel merges.
        row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        a_ptrs = part_acc_ptr + row[:, None] * BLOCK_D + d[None, :]
        tl.store(a_ptrs, acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
    else:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + head_cols
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & own_cols)


@triton.jit
def _combine_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the split-K partials of one (decode sequence, head): rescale each share to the common max."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - tok != 1:
        return
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    row = (seq * num_heads + head) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + row * 2, mask=sp_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(w * l_s, 0)
    l_tot = tl.where(l_tot > 0.0, l_tot, 1.0)
    out = tl.sum(acc * w[:, None], 0) / l_tot
    o_ptrs = out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


_SM_COUNT: dict[int, int] = {}
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


# Decode rows with sinks keep their scores in a pool (``_scratch_passes``), so K is
# read once, not three times: each decode sequence takes ``q_len`` rows of its
# ``seq_len`` query-keys (``_pool_row``: rounded up to ``POOL_ROW``) for every head, in
# order, and the sequences past the pool's end take the passes.
# 2,097,152 query-keys are a batch of 256 single-query decodes at 8,192 keys, or 32 at
# 65,536 (268 MB in bf16 for gpt-oss-20b's 64 heads).  Read at each launch (tests
# change it).
SINK_SCORES_POOL = 256 * 8192
# A pool row's length is its sequence's rounded up to this many query-keys, so that rows
# start on 16-byte boundaries (32 in a float32 pool).
POOL_ROW = tl.constexpr(8)


def sink_scratch_bytes(num_heads: int, itemsize: int) -> int:
    """Bytes of the scores pool a decode launch with sinks takes (``_launch_class``) for a
    model of ``itemsize``-byte values: the KV cache's sizing sets them aside, since its
    profiling forward runs one long sequence, not a batch of decodes."""
    return SINK_SCORES_POOL * num_heads * (4 if SINK_KEEP_EXPS else itemsize)


def _pool_row(seq_len):
    """A pool row's length for a sequence of ``seq_len`` keys (an int or a tensor)."""
    return (seq_len + POOL_ROW.value - 1) // POOL_ROW.value * POOL_ROW.value


def _pool_ends(meta: AttentionMetadata, decode_max_q: int) -> torch.Tensor:
    """int64 ``[B]``: each sequence's end in the scores pool, in query-keys a head: the
    running sum of ``q_len * row_len`` (``_pool_row``) over the decode class's sequences
    (0 for others).  Computed once a forward, on the device, so captured graphs follow
    the lengths."""
    name = f"pool_ends_{decode_max_q}"
    if name not in meta.derived:
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        shares = torch.where(q_lens <= decode_max_q, q_lens * _pool_row(meta.seq_lens), 0)
        meta.derived[name] = torch.cumsum(shares, 0, dtype=torch.int64)
    return meta.derived[name]


def _pool_size(meta: AttentionMetadata, decode_max_q: int) -> int:
    """Query-keys a head the pool holds this launch: ``SINK_SCORES_POOL``, or less when
    the host knows the lengths (an eager step) and the decode sequences need less."""
    if not meta.seq_lens_host:
        return SINK_SCORES_POOL
    starts = meta.query_start_loc_host
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    lens = meta.seq_lens_host
    need = sum(q * _pool_row(s) for q, s in zip(q_lens, lens, strict=True) if q <= decode_max_q)
    return min(SINK_SCORES_POOL, need)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: behave like an H200
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Split-K factor for single-query sequences: 2 when (sequences x KV heads) < 4 x SMs.

    Depends on the batch shape only, never on context lengths (device values),
    so a captured graph stays valid for any lengths.  Measured on the H200 at
    context 2048 (eager): Qwen3 shape B=32 68 -> 56 us, OLMoE B=32 175 -> 159
    us with 2 splits; 4 and 8 splits were no better there.
    """
    return 2 if num_seqs * num_kv_heads < 4 * _num_sms(device) else 1


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # a register cap, for more resident programs (None: ptxas's)
    pack: int = 1  # KV heads a decode program takes (``_paged_attention_kernel``'s PACK)


# KV heads a decode program with sinks may take (``_paged_attention_kernel``'s PACK).  Two
# fill gpt-oss-20b's 16-row tile with real rows (its groups are 8 heads) and, compiled for
# sm_90a, take 35% fewer instructions a key and head in the scores pool's three loops;
# not yet timed on the H200, so one until ``steady_state.py sink-tiles`` says otherwise.
# ``MOETRACE_SINK_DECODE_PACK=2`` runs a process on the packed tile, for whole-step timings.
SINK_DECODE_PACK = envs.get("MOETRACE_SINK_DECODE_PACK")
# A register cap for the window layers' one tile with sinks (0: ptxas's).  Chained at batch
# 256, 80 registers (six programs a multiprocessor, no spills) took gpt-oss-20b's window
# layers from 28.9 to 26.4 µs; the whole step has not been timed with it, so it is off
# unless ``MOETRACE_SINK_WINDOW_MAXNREG`` sets it.
SINK_WINDOW_MAXNREG = envs.get("MOETRACE_SINK_WINDOW_MAXNREG")
# The sinks' softmax, the same bits either way (``_share``, ``_scratch_passes``).
# ``SINK_RECIPROCAL``: each probability from its row's reciprocal and one FMA correction
# instead of an IEEE division.  Compiled for sm_90a it takes the default decode tile's
# pool loops from 758 to 681 instructions and its registers from 72 to 64 (eight
# programs a multiprocessor, not seven), so it is on; ``MOETRACE_SINK_RECIPROCAL=0``
# divides, for timings beside it.  ``SINK_KEEP_EXPS``: the scores pool in float32 with the
# exponentials kept between its last two loops (the packed tile's values loop 343 -> 237
# instructions, the pool's bytes doubled); not yet timed on the H200, so off unless
# ``MOETRACE_SINK_KEEP_EXPS=1`` (docs/benchmarks.md).
SINK_RECIPROCAL = envs.get("MOETRACE_SINK_RECIPROCAL")
SINK_KEEP_EXPS = envs.get("MOETRACE_SINK_KEEP_EXPS")

# Programs of the swept decode tile a multiprocessor held for Qwen3's shape when the rule
# below was measured (105 registers, 38.9 KB of shared memory: four), where the capped
# tile holds eight.  Since the key loops' block arithmetic went unsigned it compiles to
# 95 registers (five); the crossover has not been measured again, so the rule stands.
SWEPT_TILE_PROGRAMS_PER_SM = 4


def _tile_configs(
    group: int,
    head_dim: int,
    sinks: bool,
    decode_programs: int,
    num_sms: int,
    one_tile: bool = False,
) -> tuple[TileConfig, TileConfig]:
    """(decode, prefill) tiles; ``decode_programs`` is the decode launch's grid (sequences x
    KV heads x key splits); ``one_tile``: the decode rows take a window layer's one tile
    (``_one_tile_keys``), which packs no KV heads: packed, it compiles to 149-151
    registers a thread (three programs a multiprocessor; its fastest variant measured ran
    six).

    Decode: the fewest rows a tensor-core dot takes (16) or one query's group
    of heads.  Prefill: 64 rows.  From benchmarks/kernels.py on an H200: decode
    at B=256 x 384 tokens, N64 w4 s2 within 3% of the best and of dense SDPA
    (N32 up to 7% slower); prefill M64 N64 w4 s2 best for 16 x 512 new tokens
    and for 4 x 1024 after 3072 cached (M128 variants 4-28% slower).

    Groups of 8 or more heads of 128 (Qwen3-30B-A3B's 32 over 4) decode on 32-key
    tiles capped at 64 registers once their programs pass one wave of the swept tile:
    eight programs a multiprocessor where it fits four, so the grid runs in one wave,
    not two.  ``python benchmarks/steady_state.py regs regs-batches`` (chained, µs):
    batch 256 at context 320 46.2 against 47.8; batch 96 (768 programs, two splits)
    26.2 / 59.0 / 198.5 against 28.5 / 65.2 / 219.9 at contexts 320 / 1,024 / 4,096;
    batch 128 level to 5% faster; batches 160-192 level.  Grids that fit one wave
    of the swept tile lose with the capped one (batch 64, 512 programs: 45.9 against
    41.6 at context 1,024; batch 32 at 4,096 keys 118.6 against 87.8).
    """
    decode = TileConfig(max(16, triton.next_power_of_2(group)), 64, 4, 2)
    pow2_heads = head_dim == triton.next_power_of_2(head_dim)
    if sinks and not one_tile and group < decode.block_m and pow2_heads:
        pack = min(SINK_DECODE_PACK, decode.block_m // triton.next_power_of_2(group))
        decode = decode._replace(pack=pack)
    past_one_wave = decode_programs > SWEPT_TILE_PROGRAMS_PER_SM * num_sms
    if past_one_wave and group >= 8 and head_dim == 128 and not sinks:
        decode = decode._replace(block_n=32, maxnreg=64)
    prefill = TileConfig(max(64, triton.next_power_of_2(group)), 64, 4, 2)
    return decode, prefill


def decode_max_q(block_m: int, group: int, num_splits: int, pack: int = 1) -> int:
    """The longest query the decode class takes: one with key splits (their merge
    handles single queries) or packed KV heads, else as many as a tile of ``block_m``
    rows holds."""
    return 1 if num_splits > 1 or pack > 1 else max(1, block_m // group)


def _block_table_stride(meta: AttentionMetadata) -> torch.Tensor:
    """The block tables' row stride as a device int32: a padded step's tables are packed
    at a per-step width, so captured graphs read the stride instead of freezing it."""
    if meta.block_table_stride is None:
        meta.block_table_stride = torch.full(
            (1,), meta.block_tables.stride(0), dtype=torch.int32, device=meta.block_tables.device
        )
    return meta.block_table_stride


def _launch_class(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    cfg: TileConfig,
    *,
    decode: bool,
    decode_max_q: int,
    num_splits: int = 1,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch one class of sequences (decode or prefill) with an explicit tile config."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    splits = num_splits if decode else 1
    pack = cfg.pack if decode else 1
    pow2_heads = head_dim == triton.next_power_of_2(head_dim)
    if pack > 1 and (_fitting_pack(pack, splits, k_cache, v_cache) != pack or not pow2_heads):
        raise ValueError(f"a decode tile of {pack} packed KV heads does not fit this launch")
    block_q = cfg.block_m // (group * pack)
    # Tensor-core dots need K >= 16: narrower heads are padded (masked lanes read as 0).
    block_d = max(16, triton.next_power_of_2(head_dim)) * pack
    num_seqs = meta.seq_lens.shape[0]
    programs = num_seqs if decode else num_tokens // block_q + num_seqs
    heads_fast = decode and programs <= _MAX_GRID_Y
    head_programs = num_kv_heads // pack * splits
    grid = (head_programs, programs) if heads_fast else (programs, head_programs)
    use_window = sliding_window is not None and sliding_window > 0
    one_tile = _one_tile_keys(sinks is not None, decode, splits, sliding_window)
    if one_tile and cfg.maxnreg is None and SINK_WINDOW_MAXNREG:
        cfg = cfg._replace(maxnreg=SINK_WINDOW_MAXNREG)
    # Rows that one tile holds never need it (a window layer's single-query rows).
    pool = sinks is not None and decode and splits == 1 and not one_tile
    pool_size = _pool_size(meta, decode_max_q) if pool else 0
    pool = pool and pool_size > 0
    if pool:
        dtype = torch.float32 if SINK_KEEP_EXPS else q.dtype
        scores = torch.empty(pool_size * num_heads, dtype=dtype, device=q.device)
        pool_ends = _pool_ends(meta, decode_max_q)
    else:
        scores = pool_ends = out  # unused
    if splits > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, splits, block_d), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (num_seqs, num_heads, splits, 2), dtype=torch.float32, device=q.device
        )
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        scores,
        pool_ends,
        pool_size,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        _block_table_stride(meta),
        num_seqs,
        decode_max_q,
        out if sinks is None else sinks,  # unused without sinks
        scale if sinks is not None else scale * _LOG2E,
        int(sliding_window) if use_window else 0,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        NUM_SPLITS=splits,
        DECODE_CLASS=decode,
        USE_WINDOW=use_window,
        # fp32 caches get exact fp32 dots (Triton's default for fp32 is tf32).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SINKS=sinks is not None,
        PRECISE_EXP=q.is_cuda,
        HEADS_FAST=heads_fast,
        ONE_TILE=one_tile,
        SCORES_POOL=pool,
        PACK=pack,
        RECIPROCAL=SINK_RECIPROCAL,
        KEEP_EXPS=pool and SINK_KEEP_EXPS,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )
    if splits > 1:
        _combine_kernel[(num_seqs, num_heads)](
            part_acc,
            part_ml,
            out,
            meta.query_start_loc,
            num_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            SPLITS_P2=triton.next_power_of_2(splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            num_warps=4 if block_d >= 128 else 2,
        )


def _one_tile_keys(sinks: bool, decode: bool, splits: int, sliding_window: int | None) -> int:
    """Keys of the one tile that a window layer's decode rows with sinks take (0: none).

    They see at most ``window`` keys: one tile that holds them all replaces the
    three passes (H200, gpt-oss-20b: docs/benchmarks.md)."""
    if sinks and decode and splits == 1 and sliding_window and 0 < sliding_window <= 128:
        return max(16, triton.next_power_of_2(int(sliding_window)))
    return 0


def _heads_contiguous(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a token's KV heads sit side by side in both caches (what packing reads)."""
    dim = k_cache.shape[3]
    return k_cache.stride(2) == dim and v_cache.stride(2) == dim


def _fitting_pack(pack: int, splits: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The most KV heads, up to ``pack``, that a decode program can take in this launch: a
    divisor of the KV heads, none packed under key splits or with heads apart in the cache."""
    if splits > 1 or not _heads_contiguous(k_cache, v_cache):
        return 1
    while k_cache.shape[2] % pack:
        pack //= 2
    return pack


def _launch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    num_splits: int = 1,
    sinks: torch.Tensor | None = None,
    maxnreg: int | None = None,
    pack: int = 1,
) -> None:
    """Both classes with one explicit tile config (benchmarks sweep these; tests pin them)."""
    cfg = TileConfig(block_m, block_n, num_warps, num_stages, maxnreg, pack)
    group = q.shape[1] // k_cache.shape[2]
    longest = decode_max_q(block_m, group, num_splits, pack)
    for decode in (True, False):
        _launch_class(
            q, k_cache, v_cache, meta, scale, sliding_window, out, cfg,
            decode=decode, decode_max_q=longest, num_splits=num_splits, sinks=sinks,
        )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries ``q [T, Hq, D]`` over the paged cache.

    The step's own K/V must already be in the cache (``store_kv`` first).  GQA:
    ``Hq`` must be a multiple of the cache's ``Hkv``.  Softmax runs in fp32
    with online rescaling; the output has ``q``'s dtype (or ``out``'s).

    ``sinks [Hq]`` (gpt-oss): one more logit per head in every row's softmax,
    with no value.  Then the kernel rounds as transformers' eager attention,
    the only attention that family has there: scores rounded to q's dtype, the
    row max (sink included) subtracted and rounded before ``exp``, each
    probability divided by the row's sum and rounded before it weights its
    value.  That takes two passes over the keys (each row's max, then its
    sum) before the one that reads the values, except for a sliding-window
    layer's single-query rows (decode), whose at most ``window`` keys fit one
    tile that serves all three (``_sink_tile``).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if k_cache.shape[3] != head_dim or v_cache.shape[3] != head_dim:
        raise ValueError("q and the KV cache disagree on head_dim")
    if not _use_triton(q):
        raise RuntimeError("paged_attention needs CUDA tensors (or TRITON_INTERPRET=1)")
    if q.stride(2) != 1:
        q = q.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or meta.max_query_len == 0:
        return out
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}, want ({num_heads},)")
    num_seqs = meta.seq_lens.shape[0]
    splits = _num_splits(num_seqs, num_kv_heads, q.device)
    decode_cfg, prefill_cfg = _tile_configs(
        num_heads // num_kv_heads, head_dim, sinks is not None,
        num_seqs * num_kv_heads * splits, _num_sms(q.device),
        one_tile=bool(_one_tile_keys(sinks is not None, True, splits, sliding_window)),
    )  # fmt: skip
    decode_cfg = decode_cfg._replace(pack=_fitting_pack(decode_cfg.pack, splits, k_cache, v_cache))
    longest = decode_max_q(decode_cfg.block_m, num_heads // num_kv_heads, splits, decode_cfg.pack)
    # Each class is launched only if the step may hold such a sequence; skipping
    # a class whose programs would all return changes nothing in the output.
    if meta.min_query_len <= longest:
        _launch_class(
            q, k_cache, v_cache, meta, scale, sliding_window, out, decode_cfg,
            decode=True, decode_max_q=longest, num_splits=splits, sinks=sinks,
        )  # fmt: skip
    if meta.max_query_len > longest:
        _launch_class(
            q, k_cache, v_cache, meta, scale, sliding_window, out, prefill_cfg,
            decode=False, decode_max_q=longest, sinks=sinks,
        )  # fmt: skip
    return out
