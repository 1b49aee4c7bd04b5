"""q/k RMSNorm, rotary and the KV store of a fused QKV projection in one Triton launch.

``FusedQKVAttention`` on the kernels ran, between the QKV GEMM and attention,
``q_norm`` and ``k_norm`` (``triton_norm.rms_norm``), rotary on q and on k
(``triton_norm.rotary``) and the KV store (``triton_attention.store_kv``):
five launches that each read and write a slice of the projection.  Here one
launch reads it once, writes q (normed and rotated, contiguous, for
attention) and puts k and v straight into the paged caches at the step's
slots (tokens with a negative slot, padding, write nothing).

A program owns a few heads of one token: up to eight of q or of k
(``heads_per_program``; Qwen3's per-head norm takes each head's statistics
apart, heads without a norm take none), or every head of q or of k (OLMoE's
norm over the whole projection).  A head a program was the first layout: at
batch 256 that launched 9,216 one-warp programs for Qwen3-30B-A3B and 18,432
for gpt-oss-20b, and scheduling them took longer than their bytes.
Bit-identical to the five launches on
16-byte-aligned rows (``layers/residual.sixteen_byte_rows``, which the layers
check: on others Triton may lay the norm's row out otherwise than in
``rms_norm``, and the sum of squares then runs in another order):

* the norm's statistics reduce the group's row over a 1-D block of the width
  and warps ``rms_norm`` uses for it (``triton_norm.rms_rstd``: the order of
  the float32 sum follows the layout), and the row is scaled with that
  kernel's two roundings (``rms_scale``);
* the rotary rounds as the torch expression (``triton_norm.rotate_halves``):
  bfloat16 as the rotary kernel; float16 as torch's float16 ops on CUDA,
  which round each product and the sum the same way;
* k and v reach the caches as the store kernel writes them.

The halves a head's rotation pairs are read again after the statistics (from
L1), so no value moves between threads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrace.kernels.triton_norm import norm_launch, rms_rstd, rms_scale, rotate_halves
from moetrace.kernels.triton_rounding import narrow

NORMS = (None, "head", "full")


@triton.jit
def _normed_rotated(
    src,
    w_ptr,
    c1,
    c2,
    s1,
    s2,
    norm_dim,
    inv_dim,
    eps,
    h,
    i,
    ok,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
    PER_HEAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A program's heads ``src + h * HEAD_DIM`` normed (``NORM``: each head apart with
    ``PER_HEAD``, else all together) and rotated: (first, second) halves
    ``[BLOCK_G, BLOCK_HALF]`` in float32, holding ``dtype`` values."""
    HALF: tl.constexpr = HEAD_DIM // 2
    off = h * HEAD_DIM + i
    f1 = tl.load(src + off, mask=ok, other=0.0).to(tl.float32)
    f2 = tl.load(src + off + HALF, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        n = tl.arange(0, BLOCK_N)
        # The weights load before the statistics: after their cross-warp sums, a load
        # would wait out its own latency.
        if PER_HEAD:
            w_off = i  # one [HEAD_DIM] weight for every head
        else:
            w_off = off
        w1 = tl.load(w_ptr + w_off, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + w_off + HALF, mask=ok, other=0.0).to(tl.float32)
        if PER_HEAD:
            # Each head's statistics over a 1-D row, as rms_norm lays it out (the sum's
            # order follows the layout), then placed in that head's row of the tile.
            rstd = tl.zeros([BLOCK_G, 1], dtype=tl.float32)
            for j in tl.static_range(BLOCK_G):
                row = tl.load(src + j * HEAD_DIM + n, mask=n < norm_dim, other=0.0)
                rstd = tl.where(h == j, rms_rstd(row.to(tl.float32), inv_dim, eps), rstd)
        else:
            row = tl.load(src + n, mask=n < norm_dim, other=0.0).to(tl.float32)
            rstd = rms_rstd(row, inv_dim, eps)
        f1 = rms_scale(f1, rstd, w1, dtype)
        f2 = rms_scale(f2, rstd, w2, dtype)
    return rotate_halves(f1, f2, c1, c2, s1, s2, dtype)


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_t,
    stride_ct,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    norm_dim,
    inv_dim,
    q_eps,
    k_eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    NORM: tl.constexpr,
    PER_HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Token ``t``, group ``g`` of ``GROUP`` heads: q groups first (to ``q_out``), then k groups
    (k and v to the caches)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_GROUPS: tl.constexpr = NUM_HEADS // GROUP
    dtype: tl.constexpr = q_out_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_t
    h = tl.arange(0, BLOCK_G)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < GROUP) & (i < HALF)
    # cos/sin rows are [cos(f), cos(f)]: read both halves, as the reference multiplies by each.
    angles = t * stride_ct + i
    c1 = tl.load(cos_ptr + angles, mask=i < HALF, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + angles + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + angles, mask=i < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + angles + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    if g < Q_GROUPS:
        head0 = g * GROUP
        lo, hi = _normed_rotated(
            row + head0 * HEAD_DIM, q_weight_ptr, c1, c2, s1, s2, norm_dim, inv_dim, q_eps,
            h, i, ok, dtype, HEAD_DIM, NORM, PER_HEAD, BLOCK_G, BLOCK_N,
        )  # fmt: skip
        dst = q_out_ptr + (t * NUM_HEADS + head0 + h) * HEAD_DIM + i
        tl.store(dst, narrow(lo, dtype), mask=ok)
        tl.store(dst + HALF, narrow(hi, dtype), mask=ok)
    else:
        head0 = (g - Q_GROUPS) * GROUP
        # The slot and v load before the norm's statistics (see _normed_rotated).
        slot = tl.load(slot_ptr + t).to(tl.int64)
        e = tl.arange(0, BLOCK_D)[None, :]
        v_ok = (h < GROUP) & (e < HEAD_DIM)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + head0 + h) * HEAD_DIM + e, mask=v_ok)
        lo, hi = _normed_rotated(
            row + (NUM_HEADS + head0) * HEAD_DIM, k_weight_ptr, c1, c2, s1, s2, norm_dim,
            inv_dim, k_eps, h, i, ok, dtype, HEAD_DIM, NORM, PER_HEAD, BLOCK_G, BLOCK_N,
        )  # fmt: skip
        # Negative slots mark padding tokens (a CUDA graph's unused rows): as store_kv.
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + (head0 + h) * stride_kch + i
            tl.store(kc, narrow(lo, dtype).to(kc.dtype.element_ty), mask=ok)
            tl.store(kc + HALF, narrow(hi, dtype).to(kc.dtype.element_ty), mask=ok)
            vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + (head0 + h) * stride_vch + e
            tl.store(vc, v.to(vc.dtype.element_ty), mask=v_ok)


def heads_per_program(num_heads: int, num_kv_heads: int, most: int = 8) -> int:
    """Heads a program takes where no norm spans them all: the largest power of two up to
    ``most`` dividing both head counts (so no program straddles q and k)."""
    group = 1
    while group < most and num_heads % (2 * group) == 0 and num_kv_heads % (2 * group) == 0:
        group *= 2
    return group


def qkv_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    norm: str | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    q_eps: float = 0.0,
    k_eps: float = 0.0,
) -> torch.Tensor:
    """q ``[T, Hq, D]`` (contiguous) from a fused projection ``qkv [T, (Hq + 2 Hkv) D]``;
    k and v written to ``k_cache``/``v_cache`` ``[blocks, block_size, Hkv, D]`` at
    ``slot_mapping``.

    ``norm``: None, ``"head"`` (RMSNorm over each head, weights ``[D]``) or
    ``"full"`` (over all of q and all of k, weights ``[Hq D]`` and ``[Hkv D]``;
    needs ``Hq == Hkv``, one group shape for both).  ``cos``/``sin``: ``[T, D]``
    in the projection's dtype (bfloat16 or float16).
    """
    t, width = qkv.shape
    d = cos.shape[-1]
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; have {NORMS}")
    if width != (num_heads + 2 * num_kv_heads) * d or d % 2 or cos.shape != (t, d):
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {num_heads}+2x{num_kv_heads} x {d}")
    if sin.shape != cos.shape or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError("cos and sin must be [T, head_dim] in the projection's dtype")
    if qkv.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"qkv_rope_store rounds like 16-bit dtypes, got {qkv.dtype}")
    if k_cache.shape[2:] != (num_kv_heads, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit {num_kv_heads} x {d}")
    if norm == "full" and num_heads != num_kv_heads:
        raise ValueError("a norm over the whole projection needs as many q as kv heads")
    if norm is not None and (q_weight is None or k_weight is None):
        raise ValueError("a norm needs q and k weights")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    group = num_heads if norm == "full" else heads_per_program(num_heads, num_kv_heads)
    norm_dim = group * d if norm == "full" else d
    launch = norm_launch(norm_dim)
    # The norm's reduction needs rms_norm's warps for its row; without one, a warp per
    # 256 values of the program's heads.
    warps = launch.num_warps if norm is not None else norm_launch(group * d).num_warps
    weights = (q_weight, k_weight) if norm is not None else (q, q)  # unused without a norm
    _qkv_rope_store_kernel[(t, num_heads // group + num_kv_heads // group)](
        qkv,
        cos,
        sin,
        *weights,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        norm_dim,
        launch.inv_dim,
        q_eps,
        k_eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=d,
        GROUP=group,
        NORM=norm is not None,
        PER_HEAD=norm == "head",
        BLOCK_N=launch.block,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=warps,
        enable_fp_fusion=False,  # as rms_norm: no product fused into an add
    )
    return q
