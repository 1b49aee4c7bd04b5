"""Triton kernels for multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

The cache holds one row per token: the normalised KV latent ``c``
(``kv_lora_rank`` values) followed by the rotated key part shared by every
head (``qk_rope_head_dim``): ``cache [num_blocks, block_size, rank + rope]``.

One attention kernel, two forms:

- **absorbed** (every step): the query's
  no-rope part is taken through ``W_UK`` first (``q_lat = q_nope W_UK``), so
  ``score = q_lat · c + q_rot · k_rot`` is read straight off the cache; the
  output stays in latent space (``Σ p c``) and goes through ``W_UV`` after.
  Every head reads the same cache row, so a program packs ``BLOCK_H`` heads
  of one query (or a few queries) as the rows of its tile and each row read
  from the cache serves them all.
- **expanded** (prompt tokens in large steps): the cached rows of the
  sequences with more than one query are gathered and expanded through
  ``kv_b_proj`` into per-head ``k_nope`` and ``v`` (one GEMM), and the kernel
  runs per-head attention over them: ``score = q_nope · k_nope + q_rot ·
  k_rot``, ``k_rot`` still shared.  Cheaper per query for long prompts
  (192-wide scores, 128-wide values, instead of 576 and 512); it costs one
  expansion per context row.  The buffers hold as many rows as the step has
  tokens, so their size is static and bounded by the step; sequences whose
  context does not fit (behind a long cached prefix) stay in latent space.

As in ``triton_attention``, a step is launched as classes of sequences: the
single-query ones (decode) with one program per sequence and head group, its
keys split over several programs when the batch is too small to fill the GPU;
the longer ones over flattened query tiles.  Grids depend on the step's token
and sequence counts only; a program whose sequence belongs to another class
or form returns at once.  Nothing reads a device value on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moetrace.forward_context import AttentionMetadata

# Shared with the paged-attention kernels: where Triton runs, the SM count, the device-side
# block-table stride, a key's block and slot, the flattened-tile search and the merge of
# split-K partials (the same per-sequence layout).
from moetrace.kernels.triton_attention import (
    _LOG2E,
    _block_and_slot,
    _block_table_stride,
    _combine_kernel,
    _find_seq,
    _num_sms,
    _use_triton,
)

MAX_SPLITS = 16


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact float32 dots (Triton's default for them is TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block(n: int) -> int:
    """Tile width for a dimension of ``n``: a power of two, at least 16 (tensor-core dots)."""
    return max(16, triton.next_power_of_2(n))


# ---------------------------------------------------------------------------
# Latent store
# ---------------------------------------------------------------------------


@triton.jit
def _store_latent_kernel(
    latent_ptr,
    k_rot_ptr,
    cache_ptr,
    slot_ptr,
    stride_lt,
    stride_rt,
    stride_slot,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Negative slots mark padding tokens that own no cache row.
    if slot >= 0:
        t64 = t.to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        c = tl.load(latent_ptr + t64 * stride_lt + r, mask=r < RANK)
        row = cache_ptr + slot * stride_slot
        tl.store(row + r, c.to(cache_ptr.dtype.element_ty), mask=r < RANK)
        p = tl.arange(0, BLOCK_P)
        k = tl.load(k_rot_ptr + t64 * stride_rt + p, mask=p < ROPE)
        tl.store(row + RANK + p, k.to(cache_ptr.dtype.element_ty), mask=p < ROPE)


def store_latent(
    latent: torch.Tensor, k_rot: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's ``latent [T, rank]`` and ``k_rot [T, rope]`` into their cache rows.

    One program per token; a negative slot is skipped.
    """
    num_tokens, rank = latent.shape
    rope = k_rot.shape[1]
    if num_tokens == 0:
        return
    if cache.shape[-1] != rank + rope or not cache.is_contiguous():
        raise ValueError(f"cache {tuple(cache.shape)} is not a contiguous [.., {rank + rope}]")
    if latent.stride(1) != 1:
        latent = latent.contiguous()
    if k_rot.stride(1) != 1:
        k_rot = k_rot.contiguous()
    _store_latent_kernel[(num_tokens,)](
        latent,
        k_rot,
        cache,
        slot_mapping,
        latent.stride(0),
        k_rot.stride(0),
        cache.stride(-2),
        RANK=rank,
        ROPE=rope,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(rope),
        num_warps=4 if rank >= 256 else 1,
    )


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


@triton.jit
def _attend_rows(
    q1,
    q2,
    acc,
    m_i,
    l_i,
    lo,
    hi,
    pos,
    k1_ptr,
    k2_ptr,
    v_ptr,
    bt_row,
    kv_base,
    scale_log2,
    d1,
    d2,
    dv,
    stride_k1,
    stride_k2,
    stride_v,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EXPANDED: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over keys [lo, hi).  MASKED=False: every key is visible to every row.

    Key ``j``'s row is its cache slot, through the block table (absorbed form:
    ``k1`` is the latent, ``k2`` the rope key, the values are ``k1``), or row
    ``kv_base + j`` of the expanded buffers (``k1_ptr`` and ``v_ptr`` already
    point at the program's head).
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        j_ok = j < hi
        if EXPANDED:
            row = (kv_base + j).to(tl.int64)
        else:
            table_idx, slot = _block_and_slot(j, BLOCK_SIZE)
            blk = tl.load(bt_row + table_idx, mask=j_ok, other=0).to(tl.int64)
            row = blk * BLOCK_SIZE + slot
        k1 = tl.load(
            k1_ptr + row[:, None] * stride_k1 + d1[None, :],
            mask=j_ok[:, None] & (d1 < D1)[None, :],
            other=0.0,
        )
        k2 = tl.load(
            k2_ptr + row[:, None] * stride_k2 + d2[None, :],
            mask=j_ok[:, None] & (d2 < D2)[None, :],
            other=0.0,
        )
        s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            visible = (j[None, :] <= pos[:, None]) & j_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXPANDED:
            v = tl.load(
                v_ptr + row[:, None] * stride_v + dv[None, :],
                mask=j_ok[:, None] & (dv < DV)[None, :],
                other=0.0,
            )
        else:
            v = k1
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_seqs", "expand_rows"])
def _mla_attention_kernel(
    q1_ptr,
    q2_ptr,
    k1_ptr,
    k2_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    bt_stride_ptr,
    kv_start_ptr,
    num_seqs,
    expand_rows,
    scale_log2,
    num_heads,
    stride_q1t,
    stride_q1h,
    stride_q2t,
    stride_q2h,
    stride_k1,
    stride_k1h,
    stride_k2,
    stride_v,
    stride_vh,
    stride_ot,
    stride_oh,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_CLASS: tl.constexpr,
    EXPANDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Causal attention of one tile: ``BLOCK_Q`` queries x ``BLOCK_H`` heads as its rows.

    ``score = q1 · k1 + q2 · k2`` (the no-rope and the rope part).  Row r is
    query ``tile * BLOCK_Q + r // BLOCK_H``, head ``group * BLOCK_H + r % BLOCK_H``.

    Which sequences a launch serves: decode class (program ``i`` is sequence
    ``i``) the single-query ones; otherwise (flattened tiles, ``_find_seq``)
    those with more queries, split between the forms: a sequence whose
    context fits the expanded buffers (``kv_start[b] + seq_len <= expand_rows``)
    is the expanded launch's, the others the absorbed one's.  Everything else
    returns at once, so grids depend on the step's token and sequence counts alone.
    """
    pid = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_CLASS:
        seq = pid
        tile = 0
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
        tile = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_base = seq_len * 0
    expanded = seq_len < 0
    if expand_rows > 0:
        kv_base = tl.load(kv_start_ptr + seq)
        expanded = kv_base + seq_len <= expand_rows
    if DECODE_CLASS:
        mine = q_len == 1
    else:
        mine = (q_len > 1) & (expanded == EXPANDED)
    if (not mine) or (tile * BLOCK_Q >= q_len):
        return
    ctx_len = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + rows // BLOCK_H
    head = group * BLOCK_H + rows % BLOCK_H
    row_ok = (rows < BLOCK_Q * BLOCK_H) & (q_idx < q_len) & (head < num_heads)
    pos = ctx_len + q_idx
    tok = (q_start + q_idx).to(tl.int64)
    d1 = tl.arange(0, BLOCK_D1)
    d2 = tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    q1 = tl.load(
        q1_ptr + tok[:, None] * stride_q1t + head[:, None] * stride_q1h + d1[None, :],
        mask=row_ok[:, None] & (d1 < D1)[None, :],
        other=0.0,
    )
    q2 = tl.load(
        q2_ptr + tok[:, None] * stride_q2t + head[:, None] * stride_q2h + d2[None, :],
        mask=row_ok[:, None] & (d2 < D2)[None, :],
        other=0.0,
    )

    first_pos = ctx_len + tile * BLOCK_Q
    kv_lo = 0
    kv_hi = ctx_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    if NUM_SPLITS > 1:
        # Flash-decoding: this program takes one contiguous share of the keys.
        chunk = tl.cdiv(tl.cdiv(kv_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, kv_hi)
    # Keys up to the tile's first query are visible to all its rows: whole BLOCK_N
    # tiles of them skip the causal mask.
    full = tl.maximum(tl.minimum(kv_hi, first_pos + 1) - kv_lo, 0)
    full_hi = kv_lo + full // BLOCK_N * BLOCK_N

    bt_row = block_tables_ptr + seq.to(tl.int64) * tl.load(bt_stride_ptr).to(tl.int64)
    # Per-head keys and values (expanded form) start at the program's head.
    k1_head = k1_ptr + group.to(tl.int64) * stride_k1h
    v_head = v_ptr + group.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, m_i, l_i = _attend_rows(
        q1, q2, acc, m_i, l_i, kv_lo, full_hi, pos, k1_head, k2_ptr, v_head, bt_row, kv_base,
        scale_log2, d1, d2, dv, stride_k1, stride_k2, stride_v,
        D1, D2, DV, BLOCK_N, BLOCK_SIZE, EXPANDED, False, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_rows(
        q1, q2, acc, m_i, l_i, full_hi, kv_hi, pos, k1_head, k2_ptr, v_head, bt_row, kv_base,
        scale_log2, d1, d2, dv, stride_k1, stride_k2, stride_v,
        D1, D2, DV, BLOCK_N, BLOCK_SIZE, EXPANDED, True, DOT_PRECISION,
    )  # fmt: skip

    if NUM_SPLITS > 1:
        # Unnormalised partials per (decode sequence, head, split), merged by _combine_kernel.
        part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(
            o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :]
        )


def decode_splits(num_seqs: int, head_groups: int, device: torch.device) -> int:
    """Key splits per decode sequence: the power of two that brings the programs to about
    two per SM (capped at ``MAX_SPLITS``); 1 once the batch fills the GPU by itself.

    A function of the batch shape only, so a captured graph stays valid for any
    context lengths; splits that get no keys cost a masked store.
    """
    want = 2 * _num_sms(device) // max(1, num_seqs * head_groups)
    splits = 1
    while splits * 2 <= min(want, MAX_SPLITS):
        splits *= 2
    return splits


class MLAConfig(NamedTuple):
    """Tile sizes of one launch: queries and heads per tile (its rows), keys per step."""

    block_q: int
    block_h: int
    block_n: int
    splits: int
    num_warps: int
    num_stages: int


def absorbed_configs(
    num_seqs: int, num_heads: int, device: torch.device
) -> tuple[MLAConfig, MLAConfig]:
    """(decode class, prefill class) tiles of the absorbed form, by the step's shape alone.

    Decode: one query x up to 16 heads per tile (the fewest rows a tensor-core
    dot takes; its float32 accumulator is 16 x 512), keys split by
    ``decode_splits``.  Prefill: 2 queries x 16 heads on 8 warps.  Compiled
    for sm_90a in 16-bit by Triton 3.6 these take 197-198 registers on 4 warps
    (decode) and 180 on 8 warps (prefill), none spilled (an earlier build took
    255 with 16-160 bytes of stack for decode; 4 queries, or 64 keys per step,
    spilled 0.3-3.5 KB); their speed is benchmarks/mla_kernels.py's to measure.
    """
    block_h = min(16, triton.next_power_of_2(num_heads))
    splits = decode_splits(num_seqs, triton.cdiv(num_heads, block_h), device)
    decode = MLAConfig(1, block_h, 32, splits, 4, 2)
    prefill = MLAConfig(max(1, 32 // block_h), block_h, 32, 1, 8, 2)
    return decode, prefill


# Expanded form: 64 queries of one head per tile, 32 keys per step, 8 warps (24 bytes of
# stack on sm_90; 64 or 128 keys per step spill 0.3-2 KB).
EXPANDED_CONFIG = MLAConfig(64, 1, 32, 1, 8, 2)


class Expansion(NamedTuple):
    """The expanded form's inputs: per-head ``k_nope ‖ v`` and the rope keys of the context
    rows of the sequences that fit, and each sequence's first row."""

    kv: torch.Tensor  # [rows, H, nope + v_dim]
    k_rot: torch.Tensor  # [rows, rope] (a row view)
    kv_start: torch.Tensor  # int32 [B]


def _launch(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: MLAConfig,
    *,
    decode: bool,
    expansion: Expansion | None,
    expanded: bool,
    head_strides: tuple[int, int],
) -> None:
    """One launch of the attention kernel: the decode class, or the multi-query sequences
    of one form.  ``k1``, ``k2`` and ``v`` are 2-D row views (a cache slot per row, or an
    expanded context row); ``head_strides`` are k1's and v's strides between heads."""
    num_tokens, num_heads, d1 = q1.shape
    d2 = q2.shape[-1]
    dv = out.shape[-1]
    num_seqs = meta.seq_lens.shape[0]
    bq, splits = config.block_q, (config.splits if decode else 1)
    programs = num_seqs if decode else num_tokens // bq + num_seqs
    block_dv = _block(dv)
    if splits > 1:
        part_acc = q1.new_empty((num_seqs, num_heads, splits, block_dv), dtype=torch.float32)
        part_ml = q1.new_empty((num_seqs, num_heads, splits, 2), dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    expand_rows = 0 if expansion is None else expansion.kv.shape[0]
    _mla_attention_kernel[(programs, triton.cdiv(num_heads, config.block_h), splits)](
        q1,
        q2,
        k1,
        k2,
        v,
        out,
        part_acc,
        part_ml,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        _block_table_stride(meta),
        meta.seq_lens if expansion is None else expansion.kv_start,
        num_seqs,
        expand_rows,
        scale * _LOG2E,
        num_heads,
        q1.stride(0),
        q1.stride(1),
        q2.stride(0),
        q2.stride(1),
        k1.stride(0),
        head_strides[0],
        k2.stride(0),
        v.stride(0),
        head_strides[1],
        out.stride(0),
        out.stride(1),
        D1=d1,
        D2=d2,
        DV=dv,
        BLOCK_D1=_block(d1),
        BLOCK_D2=_block(d2),
        BLOCK_DV=block_dv,
        BLOCK_Q=bq,
        BLOCK_H=config.block_h,
        BLOCK_M=max(16, bq * config.block_h),
        BLOCK_N=config.block_n,
        BLOCK_SIZE=meta.block_size,
        NUM_SPLITS=splits,
        DECODE_CLASS=decode,
        EXPANDED=expanded,
        DOT_PRECISION=_dot_precision(q1.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
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
            HEAD_DIM=dv,
            BLOCK_D=block_dv,
            num_warps=4 if block_dv >= 256 else 2,
        )


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def absorbed_attention(
    q_latent: torch.Tensor,
    q_rot: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    expansion: Expansion | None = None,
    configs: tuple[MLAConfig, MLAConfig] | None = None,
) -> torch.Tensor:
    """Causal attention in latent space: ``Σ_j softmax_j(scale (q_lat · c_j + q_rot · k_rot_j)) c_j``.

    ``q_latent [T, H, rank]`` (``q_nope`` through ``W_UK``) and ``q_rot [T, H, rope]``
    may be strided views; the step's own latents must be in ``cache`` already
    (``store_latent`` first).  Returns ``[T, H, rank]`` in ``out`` (any strides)
    or a new tensor.  With ``expansion``, the rows of the sequences it holds
    are left unwritten (``expanded_attention`` serves them).  Each class of
    sequences is launched only if the step may hold one (``meta``'s query
    lengths); skipping a class whose programs would all return changes nothing.
    """
    num_tokens, num_heads, rank = q_latent.shape
    width = cache.shape[-1]
    if width != rank + q_rot.shape[-1] or not cache.is_contiguous():
        raise ValueError(f"cache {tuple(cache.shape)} does not hold rank {rank} + rope latents")
    if not _use_triton(q_latent):
        raise RuntimeError("absorbed_attention needs CUDA tensors (or TRITON_INTERPRET=1)")
    if out is None:
        out = q_latent.new_empty((num_tokens, num_heads, rank))
    if num_tokens == 0 or meta.max_query_len == 0:
        return out
    decode_cfg, prefill_cfg = configs or absorbed_configs(
        meta.seq_lens.shape[0], num_heads, q_latent.device
    )
    rows = cache.view(-1, width)
    args = (_rows_last_contiguous(q_latent), _rows_last_contiguous(q_rot), rows, rows[:, rank:])
    kw = dict(expansion=expansion, expanded=False, head_strides=(0, 0))
    if meta.min_query_len <= 1:
        _launch(*args, rows, out, meta, scale, decode_cfg, decode=True, **kw)
    if meta.max_query_len > 1:
        _launch(*args, rows, out, meta, scale, prefill_cfg, decode=False, **kw)
    return out


def expand_context(
    cache: torch.Tensor, meta: AttentionMetadata, w_kv: torch.Tensor, num_heads: int, num_rows: int
) -> Expansion:
    """The expanded form's inputs for the multi-query sequences whose contexts fit, in
    order, in ``num_rows`` rows: their cached rows gathered, the latents through
    ``kv_b_proj`` (``w_kv [H * (nope + v_dim), rank]``) in one GEMM.

    Every size is static (``num_rows``) and nothing waits for the device; rows
    past the last fitting sequence hold whatever slot they point at, and no
    kernel reads them.
    """
    width = cache.shape[-1]
    rank = w_kv.shape[1]
    bs = meta.block_size
    starts = meta.query_start_loc.to(torch.int64)
    lens = torch.where(starts[1:] - starts[:-1] > 1, meta.seq_lens.to(torch.int64), 0)
    ends = lens.cumsum(0)
    first = ends - lens
    r = torch.arange(num_rows, device=cache.device)
    seq = torch.searchsorted(ends, r, right=True).clamp_(max=lens.shape[0] - 1)
    j = r - first[seq]
    j = torch.where(j < lens[seq], j, 0)
    stride = _block_table_stride(meta).to(torch.int64)
    blocks = meta.block_tables.reshape(-1)[seq * stride + j // bs].to(torch.int64)
    rows = cache.view(-1, width)[blocks * bs + j % bs]
    kv = torch.nn.functional.linear(rows[:, :rank], w_kv).view(num_rows, num_heads, -1)
    return Expansion(kv, rows[:, rank:], first.to(torch.int32))


def expanded_attention(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    expansion: Expansion,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    config: MLAConfig = EXPANDED_CONFIG,
) -> torch.Tensor:
    """Per-head causal attention of the multi-query sequences ``expansion`` holds, over
    their expanded keys ``[k_nope ‖ k_rot]`` and values; writes those sequences' rows
    of ``out [T, H, v_dim]`` (any strides) and no others."""
    num_ctx, num_heads, width = expansion.kv.shape
    nope = q_nope.shape[-1]
    if width != nope + out.shape[-1] or not expansion.kv.is_contiguous():
        raise ValueError(f"kv {tuple(expansion.kv.shape)} is not a contiguous [C, H, nope + v]")
    if q_nope.shape[0] == 0 or num_ctx == 0 or meta.max_query_len <= 1:
        return out
    flat = expansion.kv.view(num_ctx, num_heads * width)
    _launch(
        _rows_last_contiguous(q_nope),
        _rows_last_contiguous(q_rot),
        flat,
        _rows_last_contiguous(expansion.k_rot),
        flat[:, nope:],
        out,
        meta,
        scale,
        config,
        decode=False,
        expansion=expansion,
        expanded=True,
        head_strides=(width, width),
    )
    return out
