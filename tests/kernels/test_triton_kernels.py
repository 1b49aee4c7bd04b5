"""Triton kernels (paged attention, KV store, fused MoE) against plain-torch references.

Every test needs CUDA.  With ``TRITON_INTERPRET=1`` and no GPU they run on the
CPU through Triton's interpreter at small sizes instead (slow, for developing
the kernels); without either they skip.  References compute in fp64 (attention)
or fp32 (MoE) from the same inputs, per sequence over random block tables.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from moetrace.forward_context import AttentionMetadata  # noqa: E402
from moetrace.kernels import triton_attention  # noqa: E402
from moetrace.kernels.triton_align import align_routing, align_routing_torch  # noqa: E402
from moetrace.kernels.triton_attention import (  # noqa: E402
    paged_attention,
    store_kv,
)
from moetrace.kernels.triton_moe import (  # noqa: E402
    fused_moe,
    grouped_mm_available,
    moe_forward,
    moe_grouped_mm,
)
from moetrace.layers.attention import paged_attention_torch  # noqa: E402
from moetrace.layers.moe import MoEExperts  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not HAS_CUDA
DEVICE = "cuda" if HAS_CUDA else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)"),
]
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a real CUDA device")
# Triton 3.6's interpreter computes bf16 dots wrongly (it treats the bits as integers),
# so interpreted runs check the same kernels in fp16; the GPU runs check bf16.
BF16 = torch.float16 if INTERPRET else torch.bfloat16

# ‖out − ref‖ / ‖ref‖ bounds (METHOD.md: bf16 operands land between 1e-3 and 1e-2).
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the output (unwritten or NaN)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator() -> None:
    """Fill freed CUDA cache blocks with NaN so that buffers a kernel forgets to write show up."""
    if HAS_CUDA:
        junk = torch.full((64 * 1024 * 1024,), float("nan"), device=DEVICE)
        del junk


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


class PagedBatch:
    """A packed batch over a randomly assigned paged cache, with the dense K/V kept aside."""

    def __init__(
        self,
        q_lens: list[int],
        seq_lens: list[int],
        num_kv_heads: int,
        group: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        gen: torch.Generator,
    ) -> None:
        assert all(0 < q <= s for q, s in zip(q_lens, seq_lens, strict=True))
        self.q_lens, self.seq_lens = q_lens, seq_lens
        self.group, self.head_dim, self.dtype = group, head_dim, dtype
        num_heads = num_kv_heads * group
        blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
        max_blocks = max(blocks_per_seq) + 1
        num_blocks = sum(blocks_per_seq) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        used = 0
        for b, n in enumerate(blocks_per_seq):
            tables[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
            # Padding entries point at random blocks: the kernel must never follow them.
            tables[b, n:] = torch.randint(0, num_blocks, (max_blocks - n,), generator=gen)
            used += n
        # Unwritten cache slots hold NaN: reading one poisons the output.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.keys, self.values = [], []
        slots, new_k, new_v = [], [], []
        for b, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
            k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            pos = torch.arange(s)
            slot = tables[b, pos // block_size].long() * block_size + pos % block_size
            cached = s - q_len
            # Prefix (already cached) written directly; the new tokens go through store_kv.
            self.k_cache.view(-1, num_kv_heads, head_dim)[slot[:cached]] = k[:cached]
            self.v_cache.view(-1, num_kv_heads, head_dim)[slot[:cached]] = v[:cached]
            slots.append(slot[cached:])
            new_k.append(k[cached:])
            new_v.append(v[cached:])
        total = sum(q_lens)
        self.q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
        self.new_k = torch.cat(new_k)
        self.new_v = torch.cat(new_v)
        qsl = [0]
        for q_len in q_lens:
            qsl.append(qsl[-1] + q_len)
        self.meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(DEVICE),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            query_start_loc_host=qsl,
            seq_lens_host=list(seq_lens),
        )
        self.q = self.q.to(DEVICE)
        self.new_k = self.new_k.to(DEVICE)
        self.new_v = self.new_v.to(DEVICE)
        self.k_cache = self.k_cache.to(DEVICE)
        self.v_cache = self.v_cache.to(DEVICE)

    def reference(
        self, scale: float, window: int | None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp64 causal attention per sequence from the dense K/V (``sinks``: a logit per head)."""
        outs = []
        start = 0
        for b, (q_len, s) in enumerate(zip(self.q_lens, self.seq_lens, strict=True)):
            q = self.q[start : start + q_len].cpu().double()  # [q, Hq, D]
            k = self.keys[b].double().repeat_interleave(self.group, dim=1)  # [s, Hq, D]
            v = self.values[b].double().repeat_interleave(self.group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            pos = torch.arange(s - q_len, s)[:, None]
            j = torch.arange(s)[None, :]
            visible = j <= pos
            if window is not None:
                visible &= pos - j < window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is None:
                probs = scores.softmax(-1)
            else:
                sink = sinks.cpu().double()[:, None, None].expand(-1, q_len, 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            outs.append(torch.einsum("hqk,khd->qhd", probs, v))
            start += q_len
        return torch.cat(outs)


def _check_attention(
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = PagedBatch(q_lens, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, gen)
    store_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    # The stored rows are exactly the new K/V.
    kc = batch.k_cache.view(-1, num_kv_heads, head_dim)
    vc = batch.v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(kc[batch.meta.slot_mapping], batch.new_k)
    assert torch.equal(vc[batch.meta.slot_mapping], batch.new_v)

    scale = head_dim**-0.5
    out = torch.full_like(batch.q, float("nan"))
    res = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, sliding_window=window, out=out
    )
    assert res.data_ptr() == out.data_ptr()
    ref = batch.reference(scale, window)
    err = rel_err(out.cpu(), ref)
    assert err < TOL[dtype], f"relative error {err:.2e}"

    # Without `out`: a fresh tensor, same values.
    again = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, sliding_window=window
    )
    assert torch.equal(again, out)


if INTERPRET:
    DECODE_CTX = [1, 5, 17, 40]
    PREFILL = ([1, 9, 4, 1, 13], [30, 9, 20, 3, 13])
else:
    DECODE_CTX = [1, 17, 200, 384, 385, 1000, 2047, 64, 129, 511] * 4
    PREFILL = (
        [1, 300, 37, 1, 128, 1, 1000, 5],
        [700, 300, 600, 2, 1100, 2048, 1000, 5],
    )


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(4, 8, 128, 16), (2, 4, 64, 32), (16, 1, 128, 16), (3, 4, 128, 32), (2, 8, 64, 16)],
)
def test_decode(
    dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    seq_lens = DECODE_CTX
    _check_attention(
        [1] * len(seq_lens), seq_lens, num_kv_heads, group, head_dim, block_size, dtype
    )


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(4, 8, 128, 16), (2, 4, 64, 32), (4, 1, 128, 32), (2, 8, 64, 16)],
)
def test_mixed_prefill_decode_prefix_hits(
    dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    """Whole prompts, chunks after a cached prefix (q_len < seq_len) and decodes in one launch."""
    q_lens, seq_lens = PREFILL
    _check_attention(q_lens, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=1)


def _step_lengths(decode: bool) -> tuple[list[int], list[int]]:
    """(query lengths, sequence lengths) of a decode batch or of the mixed prefill batch."""
    if decode:
        return [1] * len(DECODE_CTX), DECODE_CTX
    return PREFILL


@pytest.mark.parametrize("window", [1, 7, 64, 300])
@pytest.mark.parametrize("decode", [True, False])
def test_sliding_window(window: int, decode: bool) -> None:
    q_lens, seq_lens = _step_lengths(decode)
    _check_attention(q_lens, seq_lens, 2, 4, 64, 16, BF16, window=window, seed=2)


@pytest.mark.parametrize("head_dim", [8, 24])
@pytest.mark.parametrize("decode", [True, False])
def test_heads_narrower_than_a_tensor_core_dot(head_dim: int, decode: bool) -> None:
    """Tiny test checkpoints have 8-wide heads; the dots need K >= 16, so lanes are padded."""
    q_lens, seq_lens = _step_lengths(decode)
    _check_attention(q_lens, seq_lens, 2, 2, head_dim, 16, BF16, seed=4)


def test_fp32_cache() -> None:
    q_lens, seq_lens = PREFILL
    _check_attention(q_lens, seq_lens, 2, 2, 64, 16, torch.float32, seed=3)


@pytest.mark.parametrize(
    ("group", "head_dim", "sinks", "programs", "capped"),
    [
        (8, 128, False, 256 * 4, True),  # Qwen3 at batch 256, one split: two waves uncapped
        (8, 128, False, 96 * 4 * 2, True),  # batch 96, two splits: 768 programs
        (8, 128, False, 64 * 4 * 2, False),  # batch 64: 512 fit one wave of the swept tile
        (8, 128, False, 4 * 132, False),  # exactly one wave
        (8, 128, False, 4 * 132 + 1, True),
        (1, 128, False, 256 * 16, False),  # OLMoE: no groups, 4,096 programs fill any tile
        (8, 64, True, 256 * 8, False),  # gpt-oss: heads of 64, sinks
    ],
)
def test_capped_decode_tile_only_past_one_wave(group, head_dim, sinks, programs, capped) -> None:
    """The capped tile is chosen where it was measured to win: Qwen3's shape, grids the
    swept tile runs in two waves."""
    cfg = triton_attention._tile_configs(group, head_dim, sinks, programs, 132)[0]
    assert (cfg.maxnreg is not None) == capped


def test_decode_on_the_full_batch_tile() -> None:
    """Qwen3's shape (4 KV heads, groups of 8, heads of 128) on the tile its batches past
    one wave of the swept tile take (32 keys, a register cap): the reference result.  The
    other tests' batches are small enough for the swept tile."""
    cfg = triton_attention._tile_configs(8, 128, False, 256 * 4, 132)[0]
    assert cfg.maxnreg is not None  # the capped tile, not the one the other tests cover
    gen = torch.Generator().manual_seed(13)
    seq_lens = DECODE_CTX
    batch = PagedBatch([1] * len(seq_lens), seq_lens, 4, 8, 128, 16, BF16, gen)
    store_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = torch.full_like(batch.q, float("nan"))
    triton_attention._launch_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, 128**-0.5, None, out,
        cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, 1, maxnreg=cfg.maxnreg,
    )  # fmt: skip
    err = rel_err(out.cpu(), batch.reference(128**-0.5, None))
    assert err < TOL[BF16], f"relative error {err:.2e}"


@pytest.mark.parametrize("window", [None, 50])
def test_decode_split_k(window: int | None) -> None:
    """Every split-K factor gives the reference result, including splits with no keys."""
    gen = torch.Generator().manual_seed(12)
    seq_lens = DECODE_CTX[:10]
    batch = PagedBatch([1] * len(seq_lens), seq_lens, 2, 4, 64, 16, BF16, gen)
    store_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    ref = batch.reference(0.125, window)
    for splits in (1, 2, 3, 8):
        out = torch.full_like(batch.q, float("nan"))
        triton_attention._launch_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.meta,
            0.125,
            window,
            out,
            16,
            32,
            4,
            2,
            splits,
        )
        err = rel_err(out.cpu(), ref)
        assert err < TOL[BF16], f"{splits} splits: relative error {err:.2e}"


def test_store_kv_skips_negative_slots() -> None:
    """Padding rows (slot -1) leave the cache untouched; strided (qkv-split) inputs work."""
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, heads, dim = 6, 16, 2, 64
    cache_k = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE)
    cache_v = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    qkv = torch.randn(5, 3 * heads * dim, generator=gen).to(DEVICE)
    k = qkv[:, heads * dim : 2 * heads * dim].view(5, heads, dim)
    v = qkv[:, 2 * heads * dim :].view(5, heads, dim)
    slots = torch.tensor([3, -1, 40, 95, -1], dtype=torch.int64, device=DEVICE)
    store_kv(k, v, cache_k, cache_v, slots)
    flat_k = cache_k.view(-1, heads, dim)
    flat_v = cache_v.view(-1, heads, dim)
    keep = torch.ones(num_blocks * block_size, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[i]) and torch.equal(flat_v[s], v[i])
            keep[s] = False
    assert torch.equal(flat_k[keep.to(DEVICE)], before_k.view(-1, heads, dim)[keep.to(DEVICE)])
    assert torch.equal(flat_v[keep.to(DEVICE)], before_v.view(-1, heads, dim)[keep.to(DEVICE)])


# ---------------------------------------------------------------------------
# Fused MoE
# ---------------------------------------------------------------------------


def skewed_routing(
    num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing with a Zipf-like skew where some experts get no token at all."""
    live = max(top_k, num_experts // 2)
    bias = torch.full((num_experts,), float("-inf"))
    bias[:live] = -torch.log(torch.arange(1, live + 1, dtype=torch.float32)) * 2.0
    bias = bias[torch.randperm(num_experts, generator=gen)]
    logits = torch.randn(num_tokens, num_experts, generator=gen) + bias
    vals, ids = logits.topk(top_k, dim=-1)
    weights = vals.softmax(-1)
    return weights.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """fp32, one expert at a time."""
    inter = w2.shape[2]
    x = x.float()
    out = torch.zeros_like(x)
    ids = ids.long()
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].float().T
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = (a @ w2[e].float().T) * weights[tok, slot, None].float()
        out.index_add_(0, tok, y)
    return out


def make_moe(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    dtype = BF16
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = skewed_routing(num_tokens, num_experts, top_k, gen)
    return x, w13.to(DEVICE), w2.to(DEVICE), weights, ids


if INTERPRET:
    MOE_TOKENS, MOE_EXPERTS, MOE_SHAPE = [1, 7, 33], [8], (64, 32)
else:
    MOE_TOKENS, MOE_EXPERTS, MOE_SHAPE = [1, 7, 256, 2048], [8, 64, 128], (512, 256)


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("num_experts", MOE_EXPERTS)
@pytest.mark.parametrize("num_tokens", MOE_TOKENS)
def test_fused_moe(num_tokens: int, num_experts: int, top_k: int) -> None:
    hidden, inter = MOE_SHAPE
    x, w13, w2, weights, ids = make_moe(
        num_tokens, num_experts, top_k, hidden, inter, seed=num_tokens
    )
    ref = moe_reference(x, w13, w2, weights, ids)
    poison_allocator()
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = rel_err(out, ref)
    assert err < TOL[torch.bfloat16], f"fused_moe relative error {err:.2e}"
    poison_allocator()
    err = rel_err(moe_forward(x, w13, w2, weights, ids), ref)
    assert err < TOL[torch.bfloat16], f"moe_forward relative error {err:.2e}"


def test_fused_moe_uneven_sizes() -> None:
    """H and I not multiples of the K tile; int64 ids."""
    hidden, inter = (72, 40) if INTERPRET else (1000, 328)
    x, w13, w2, weights, ids = make_moe(37, 8, 2, hidden, inter, seed=5)
    ref = moe_reference(x, w13, w2, weights, ids)
    poison_allocator()
    err = rel_err(fused_moe(x, w13, w2, weights, ids.long()), ref)
    assert err < TOL[torch.bfloat16], f"relative error {err:.2e}"


def test_fused_moe_gelu_tanh() -> None:
    hidden, inter = MOE_SHAPE
    x, w13, w2, weights, ids = make_moe(19, 8, 2, hidden, inter, seed=6)
    out = fused_moe(x, w13, w2, weights, ids, activation="gelu_tanh")
    ref = torch.zeros(x.shape, dtype=torch.float32, device=DEVICE)
    for e in range(8):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        h = x[tok].float() @ w13[e].float().T
        a = torch.nn.functional.gelu(h[:, :inter], approximate="tanh") * h[:, inter:]
        ref.index_add_(0, tok, (a @ w2[e].float().T) * weights[tok, slot, None])
    err = rel_err(out, ref)
    assert err < TOL[torch.bfloat16], f"relative error {err:.2e}"


def _parts_outputs(call, monkeypatch, attribute: str, parts: tuple[int, ...]) -> list:
    """``call()`` with the experts' row blocks split into each count of ``parts``."""
    from moetrace.kernels import triton_moe

    outs = []
    for count in parts:
        monkeypatch.setattr(triton_moe, attribute, count)
        poison_allocator()
        outs.append(call())
    return outs


@pytest.mark.parametrize("layout", ["sorted", "table"])
def test_expert_parts_give_the_one_part_output(layout: str, monkeypatch) -> None:
    """Row blocks split into two or three parts (side streams on CUDA) give the one-part
    output bit for bit: each block is computed once, by one part.  37 tokens x top-2 over 8
    experts in 32-row blocks: 11 blocks, so the parts are uneven."""
    from moetrace.kernels.triton_moe import expert_parts, fused_moe_with_config, moe_config
    from moetrace.kernels.triton_routing import route_and_align

    hidden, inter = MOE_SHAPE
    x, w13, w2, _, _ = make_moe(37, 8, 2, hidden, inter, seed=21)
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(37, 8, generator=gen).to(DEVICE)
    cfg = moe_config(37, 2, 8)
    fused = route_and_align(logits, 2, "softmax_topk", cfg.block_m, weights_dtype=BF16)
    assert fused.aligned.num_blocks == 11 and expert_parts(37 * 2 / 8, 11, 2) == 2
    if layout == "table":
        extra = dict(aligned=fused.aligned, weights_f32=fused.weights_f32)
    else:
        extra = {}

    def call() -> torch.Tensor:
        return fused_moe_with_config(
            x, w13, w2, fused.weights, fused.ids, cfg, combine=False, **extra
        )  # fmt: skip

    one, two, three = _parts_outputs(call, monkeypatch, "EXPERT_STREAMS", (1, 2, 3))
    assert torch.equal(two, one) and torch.equal(three, one)
    ref = moe_reference(x, w13, w2, fused.weights, fused.ids)
    assert rel_err(one.float().sum(dim=1), ref) < TOL[torch.bfloat16]


def test_fragment_expert_parts_give_the_one_part_output(monkeypatch) -> None:
    """The MXFP4 fragment GEMMs take the same split (one part by default: measured slower)."""
    experts = gpt_oss_experts("mxfp4-fragment", 96, 96, seed=23, num_experts=5)
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(41, 96, generator=gen).to(BF16).to(DEVICE)
    weights, ids = skewed_routing(41, 5, 2, gen)
    experts.use_triton = True

    def call() -> torch.Tensor:
        return experts(x, weights.to(BF16), ids)

    one, two = _parts_outputs(call, monkeypatch, "FRAGMENT_STREAMS", (1, 2))
    assert torch.equal(two, one)


@cuda_only
def test_expert_parts_replay_in_a_cuda_graph(monkeypatch) -> None:
    """The parts' side streams fork from and join the capturing stream: a replay of the
    two-part call gives the eager one-part output, and no stream is left unjoined."""
    from moetrace.kernels import triton_moe

    x, w13, w2, weights, ids = make_moe(256, 64, 8, 512, 256, seed=25)
    monkeypatch.setattr(triton_moe, "EXPERT_STREAMS", 1)
    eager = fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(triton_moe, "EXPERT_STREAMS", 2)
    fused_moe(x, w13, w2, weights, ids)  # compiles the part kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    # One planning program; eight with 11 chunks of rows (three programs label blocks);
    # eight with 17 chunks (each marks two or three).
    [(50, 16, 4, 16), (300, 128, 8, 64), (1, 64, 8, 16), (2048, 64, 8, 16)],
)
def test_align_routing(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(7)
    _, ids = skewed_routing(num_tokens, num_experts, top_k, gen)
    routing = align_routing(ids, num_experts, block_m)
    sorted_ids = routing.sorted_pair_ids.cpu()
    experts = routing.block_expert_ids.cpu()
    total = int(routing.num_rows_padded.item())
    flat = ids.reshape(-1).cpu().long()
    valid = sorted_ids[sorted_ids < flat.numel()]
    assert sorted(valid.tolist()) == list(range(flat.numel()))  # every pair exactly once
    assert total % block_m == 0 and (sorted_ids[total:] == flat.numel()).all()
    for blk in range(total // block_m):
        pairs = sorted_ids[blk * block_m : (blk + 1) * block_m]
        pairs = pairs[pairs < flat.numel()]
        assert pairs.numel() > 0 and (flat[pairs] == experts[blk]).all()
    assert (experts[total // block_m :] == num_experts).all()
    # Same layout as the torch version, up to the order inside each expert's group.
    ref = align_routing_torch(ids, num_experts, block_m)
    assert torch.equal(ref.block_expert_ids.cpu(), experts)
    assert int(ref.num_rows_padded.item()) == total
    ref_ids = ref.sorted_pair_ids.cpu()
    for e in range(num_experts):
        rows = (experts == e).repeat_interleave(block_m)
        assert torch.equal(sorted_ids[rows].sort().values, ref_ids[rows].sort().values)


@cuda_only
@pytest.mark.skipif(not grouped_mm_available(), reason="no grouped_mm in this torch")
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
def test_moe_grouped_mm(num_tokens: int) -> None:
    x, w13, w2, weights, ids = make_moe(num_tokens, 64, 8, 512, 256, seed=8)
    ref = moe_reference(x, w13, w2, weights, ids)
    err = rel_err(moe_grouped_mm(x, w13, w2, weights, ids), ref)
    assert err < TOL[torch.bfloat16], f"relative error {err:.2e}"


# ---------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------


@cuda_only
def test_cuda_graph_decode_attention_and_moe() -> None:
    """Capture store_kv + decode attention + fused MoE once, replay with new inputs."""
    gen = torch.Generator().manual_seed(9)
    num_kv_heads, group, head_dim, block_size = 4, 8, 128, 16
    batch_a = PagedBatch([1] * 32, [300] * 32, num_kv_heads, group, head_dim, block_size,
                         torch.bfloat16, gen)  # fmt: skip
    seq_b = torch.randint(1, 300, (32,), generator=gen).tolist()
    batch_b = PagedBatch([1] * 32, seq_b, num_kv_heads, group, head_dim, block_size,
                         torch.bfloat16, gen)  # fmt: skip
    # Same cache shapes: give both the larger block count.
    assert batch_b.k_cache.shape[0] <= batch_a.k_cache.shape[0]
    x_a, w13, w2, wts_a, ids_a = make_moe(32, 64, 8, 512, 256, seed=10)
    x_b, _, _, wts_b, ids_b = make_moe(32, 64, 8, 512, 256, seed=11)

    meta = batch_a.meta
    k_cache, v_cache = batch_a.k_cache.clone(), batch_a.v_cache.clone()
    static = {
        "q": batch_a.q.clone(),
        "k": batch_a.new_k.clone(),
        "v": batch_a.new_v.clone(),
        "x": x_a.clone(),
        "wts": wts_a.clone(),
        "ids": ids_a.clone(),
    }
    scale = head_dim**-0.5

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        store_kv(static["k"], static["v"], k_cache, v_cache, meta.slot_mapping)
        attn = paged_attention(static["q"], k_cache, v_cache, meta, scale)
        moe = fused_moe(static["x"], w13, w2, static["wts"], static["ids"])
        return attn, moe

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn_out, moe_out = step()

    # New step: copy batch B into the static buffers (cache contents, metadata, inputs).
    nb = batch_b.k_cache.shape[0]
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    k_cache[:nb].copy_(batch_b.k_cache)
    v_cache[:nb].copy_(batch_b.v_cache)
    meta.seq_lens.copy_(batch_b.meta.seq_lens)
    meta.slot_mapping.copy_(batch_b.meta.slot_mapping)
    meta.block_tables.zero_()
    cols = batch_b.meta.block_tables.shape[1]
    meta.block_tables[:, :cols].copy_(batch_b.meta.block_tables)
    for name, src in (("q", batch_b.q), ("k", batch_b.new_k), ("v", batch_b.new_v)):
        static[name].copy_(src)
    static["x"].copy_(x_b)
    static["wts"].copy_(wts_b)
    static["ids"].copy_(ids_b)
    graph.replay()
    torch.cuda.synchronize()

    eager_k, eager_v = batch_b.k_cache.clone(), batch_b.v_cache.clone()
    store_kv(batch_b.new_k, batch_b.new_v, eager_k, eager_v, batch_b.meta.slot_mapping)
    eager_attn = paged_attention(batch_b.q, eager_k, eager_v, batch_b.meta, scale)
    eager_moe = fused_moe(x_b, w13, w2, wts_b, ids_b)
    assert torch.equal(attn_out, eager_attn)
    assert torch.equal(moe_out, eager_moe)
    assert rel_err(attn_out.cpu(), batch_b.reference(scale, None)) < TOL[torch.bfloat16]


# ---------------------------------------------------------------------------
# Attention sinks (gpt-oss)
# ---------------------------------------------------------------------------


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sinks large enough to take a visible share of each softmax."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 2).to(BF16).to(DEVICE)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("decode", [True, False])
def test_sinks_match_the_reference_and_the_plain_path(window: int | None, decode: bool) -> None:
    """The sink joins each row's softmax; rounding follows the plain path (eager attention)."""
    q_lens, seq_lens = _step_lengths(decode)
    gen = torch.Generator().manual_seed(13)
    batch = PagedBatch(q_lens, seq_lens, 2, 4, 64, 16, BF16, gen)
    store_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    sinks = _sinks(8, seed=3)
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, sliding_window=window, sinks=sinks
    )
    err = rel_err(out.cpu(), batch.reference(0.125, window, sinks))
    assert err < TOL[BF16], f"relative error {err:.2e}"
    assert rel_err(out.cpu(), batch.reference(0.125, window)) > 3 * TOL[BF16]  # sinks count


@pytest.mark.parametrize("decode", [True, False])
def test_sinks_round_like_eager_attention(decode: bool) -> None:
    """Scores near 200 are 16-bit numbers 1/8 (fp16) or 1 (bf16) apart: rounding moves weights.

    The plain path rounds scores and ``score - max`` as transformers' eager
    attention does; the kernel must land on it, far closer than either is to
    the exact softmax.
    """
    q_lens, seq_lens = _step_lengths(decode)
    gen = torch.Generator().manual_seed(15)
    batch = PagedBatch(q_lens, seq_lens, 2, 4, 64, 16, BF16, gen)
    # One shared direction adds 64 * 25 to every q.k: scores 200 +- 1 after the scale.
    batch.q[..., 0] = 64.0
    for t in (batch.new_k, batch.k_cache, *batch.keys):
        t[..., 0] = 25.0
    store_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    sinks = _sinks(8, seed=5) + 200.0
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, sinks=sinks)
    plain = paged_attention_torch(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, sinks=sinks
    )
    exact = batch.reference(0.125, None, sinks)
    assert rel_err(plain.cpu(), exact) > 3 * TOL[BF16]
    # bf16 scores near 200 are 1 apart: a score a summation order rounds to the
    # neighbouring value moves its weight by e, so allow a full tolerance.
    assert rel_err(out, plain) < TOL[BF16], rel_err(out, plain)


@pytest.mark.parametrize("window", [None, 50])
def test_sinks_through_split_k(window: int | None) -> None:
    """Each split subtracts the row's own max; the sink is counted once, whatever the splits."""
    gen = torch.Generator().manual_seed(14)
    seq_lens = DECODE_CTX[:10]
    batch = PagedBatch([1] * len(seq_lens), seq_lens, 2, 4, 64, 16, BF16, gen)
    store_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    sinks = _sinks(8, seed=4)
    ref = batch.reference(0.125, window, sinks)
    outs = []
    for splits in (1, 2, 3, 8):
        out = torch.full_like(batch.q, float("nan"))
        triton_attention._launch_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, window, out,
            16, 32, 4, 2, splits, sinks=sinks,
        )  # fmt: skip
        err = rel_err(out.cpu(), ref)
        assert err < TOL[BF16], f"{splits} splits: relative error {err:.2e}"
        outs.append(out)
    # Every split subtracts the same max: the partial sums differ only in order.
    for out in outs[1:]:
        assert rel_err(out, outs[0]) < TOL[BF16] / 2


# ---------------------------------------------------------------------------
# gpt-oss experts: biases, clamped SwiGLU, MXFP4
# ---------------------------------------------------------------------------


def gpt_oss_experts(
    weight_format: str, hidden: int, inter: int, seed: int, num_experts: int = 8
) -> MoEExperts:
    """Random gpt-oss experts in BF16 on DEVICE: biases, a tight clamp, dense or MXFP4.

    ``weight_format``: ``"dense"``, ``"mxfp4"`` (the default layout) or
    ``"mxfp4-checkpoint"`` / ``"mxfp4-fragment"``.  MXFP4 codes and scales are
    drawn in the checkpoint layout and loaded as a checkpoint is, so every
    layout holds the same values for one seed.
    """
    gen = torch.Generator().manual_seed(seed)
    fmt, _, layout = weight_format.partition("-")
    experts = MoEExperts(
        num_experts,
        hidden,
        inter,
        "clamped_swiglu",
        bias=True,
        activation_args={"alpha": 1.702, "limit": 1.5},  # clamps bite: |pre-activations| ~ 1
        weight_format=fmt,
        mxfp4_layout=layout or None,
    )
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if name.endswith("_scale"):
                continue
            if param.dtype == torch.uint8:
                rows, k = param.shape[1], param.shape[2] * 2
                fan_in = hidden if name == "w13" else inter
                exponent = 127 - round(math.log2(2.9 * fan_in**0.5))  # e2m1 RMS 2.9
                blocks = torch.randint(0, 256, param.shape, generator=gen, dtype=torch.uint8)
                scales = torch.randint(
                    exponent - 1, exponent + 2, (num_experts, rows, k // 32), generator=gen
                ).to(torch.uint8)
                experts.load_mxfp4(name, blocks, scales)
            elif name.startswith("b"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return experts.to(BF16).to(DEVICE)


@pytest.mark.parametrize("weight_format", ["dense", "mxfp4-checkpoint", "mxfp4-fragment"])
@pytest.mark.parametrize("num_tokens", [1, 7, 33] if INTERPRET else [1, 7, 256, 2048])
def test_gpt_oss_experts_kernel_matches_the_plain_path(weight_format: str, num_tokens: int) -> None:
    """Biases, the clamped SwiGLU (rounded as the reference rounds) and MXFP4 decoding."""
    hidden, inter = (96, 64) if INTERPRET else (2880, 2880)  # 96: a K tail of 32 values
    experts = gpt_oss_experts(weight_format, hidden, inter, seed=num_tokens)
    gen = torch.Generator().manual_seed(num_tokens + 1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(BF16).to(DEVICE)
    weights, ids = skewed_routing(num_tokens, 8, 4, gen)
    weights = weights.to(BF16)
    plain = experts.forward_torch(x, weights, ids)
    experts.use_triton = True
    poison_allocator()
    fused = experts(x, weights, ids)
    assert fused.dtype == x.dtype
    # The same roundings, other summation orders: a few units in the last place.
    err = rel_err(fused, plain.float())
    assert err < TOL[BF16] / 2, f"relative error {err:.2e}"
    # The plain path's own check: the clamps bit and the biases count.
    gate_up = torch.cat([experts._dense_weights(e, torch.float32)[0].float() for e in range(8)])
    assert (x.float() @ gate_up.T).abs().max() > 1.5


@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_mxfp4_dot_scaled_equals_the_bit_decoder(num_tokens: int) -> None:
    """MXFP4 decoded by ``tl.dot_scaled`` and by the kernel's own bits agree, on the tiles used."""
    from moetrace.kernels.triton_moe import fused_moe_with_config, moe_config

    experts = gpt_oss_experts("mxfp4-checkpoint", 2880, 2880, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_tokens, 2880, generator=gen).to(BF16).to(DEVICE)
    weights, ids = skewed_routing(num_tokens, 8, 4, gen)
    cfg = moe_config(num_tokens, 4, 8, mxfp4=True)
    outs = [
        fused_moe_with_config(
            x,
            experts.w13,
            experts.w2,
            weights.to(BF16),
            ids,
            cfg,
            "clamped_swiglu",
            extras=experts._kernel_extras(),
            mxfp4_native=native,
        )  # fmt: skip
        for native in (True, False)
    ]
    assert rel_err(outs[0], outs[1].float()) < TOL[BF16] / 3


# ---------------------------------------------------------------------------
# MXFP4 in the fragment layout (kernels/mxfp4_layout.py)
# ---------------------------------------------------------------------------

# Scales from the bottom of the e8m0 range to the top a checkpoint could use (the generic
# decoder reaches 240; the fast one 128, past which load_mxfp4 flags the experts).
EDGE_SCALES = (0, 1, 2, 64, 110, 120, 126, 127, 128)


def fragment_matrix(rows: int, k: int, scales: tuple[int, ...], seed: int):
    """Random codes (every code in every row, 0.5 and -0 included) under the given scales:
    checkpoint ``(blocks, scales)`` and the same matrix in the fragment layout."""
    from moetrace.kernels.mxfp4_layout import to_fragment

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    blocks[:, :8] = torch.arange(0, 16, 2) | (torch.arange(1, 16, 2) << 4)  # codes 0..15
    choice = torch.tensor(scales, dtype=torch.uint8)
    scale = choice[torch.randint(0, len(scales), (rows, k // 32), generator=gen)]
    return (blocks, scale), to_fragment(blocks, scale, gate_up=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [96, 288])
def test_fragment_generic_decoder_equals_the_reference(dtype: torch.dtype, k: int) -> None:
    """Bit for bit, in the interpreter too; K of 96 (one short chunk) and 288 (two whole
    chunks and a short one), the e8m0 edges."""
    from moetrace.kernels.triton_mxfp4 import decode_fragment
    from moetrace.layers.mxfp4 import dequantize_mxfp4

    (blocks, scales), (packed, padded) = fragment_matrix(32, k, (*EDGE_SCALES, 200, 240), 1)
    want = dequantize_mxfp4(blocks.unflatten(-1, (-1, 16)), scales, dtype)
    got = decode_fragment(packed.to(DEVICE), padded.to(DEVICE), dtype, fast=False).cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # -0 and infinities too


@cuda_only
@pytest.mark.parametrize("k", [96, 2880])
def test_fragment_fast_decoder_equals_the_reference_bits(k: int) -> None:
    """The PTX decoder (bf16 multiply of a subnormal for 0.5) against the reference and
    the generic decoder, every code at every scale it serves."""
    from moetrace.kernels.triton_mxfp4 import decode_fragment
    from moetrace.layers.mxfp4 import dequantize_mxfp4

    (blocks, scales), (packed, padded) = fragment_matrix(64, k, EDGE_SCALES, 2)
    want = dequantize_mxfp4(blocks.unflatten(-1, (-1, 16)), scales, torch.bfloat16)
    fast = decode_fragment(packed.to(DEVICE), padded.to(DEVICE), torch.bfloat16, fast=True)
    generic = decode_fragment(packed.to(DEVICE), padded.to(DEVICE), torch.bfloat16, fast=False)
    assert torch.equal(fast.cpu().view(torch.int16), want.view(torch.int16))
    assert torch.equal(generic.cpu().view(torch.int16), want.view(torch.int16))


def test_fragment_kernel_odd_experts_and_tails() -> None:
    """5 experts, K tails in both GEMMs (96 = 128 - 32), N tails (96 of 64-channel tiles and
    128-row tiles), an empty expert; the kernel against the plain path."""
    experts = gpt_oss_experts("mxfp4-fragment", 96, 96, seed=11, num_experts=5)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(21, 96, generator=gen).to(BF16).to(DEVICE)
    weights, ids = skewed_routing(21, 5, 2, gen)
    ids[ids == 3] = 4  # expert 3 gets nothing
    weights = weights.to(BF16)
    plain = experts.forward_torch(x, weights, ids)
    experts.use_triton = True
    poison_allocator()
    fused = experts(x, weights, ids)
    err = rel_err(fused, plain.float())
    assert err < TOL[BF16] / 2, f"relative error {err:.2e}"


def test_fragment_kernels_read_the_fused_routings_table() -> None:
    """gpt-oss routed by the fused kernel (top-k, then softmax): the fragment GEMMs read
    its table of pairs and give the sorted layout's output bit for bit."""
    from moetrace.kernels.triton_moe import fused_moe_with_config, moe_config
    from moetrace.kernels.triton_routing import route_and_align

    experts = gpt_oss_experts("mxfp4-fragment", 96, 96, seed=31, num_experts=5)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(29, 96, generator=gen).to(BF16).to(DEVICE)
    logits = torch.randn(29, 5, generator=gen).to(DEVICE)
    cfg = moe_config(29, 2, 5, mxfp4=True, layout="fragment")
    fused = route_and_align(logits, 2, "topk_softmax", cfg.block_m, weights_dtype=BF16)
    assert fused.aligned.is_table

    def call(**prepared) -> torch.Tensor:
        poison_allocator()
        return fused_moe_with_config(
            x, experts.w13, experts.w2, fused.weights, fused.ids, cfg, "clamped_swiglu",
            extras=experts._kernel_extras(), **prepared,
        )  # fmt: skip

    table_out = call(aligned=fused.aligned, weights_f32=fused.weights_f32)
    assert torch.equal(table_out, call())


@pytest.mark.parametrize("tokens", [29, 90])
def test_fragment_kernels_give_loaded_experts_their_own_blocks(tokens: int) -> None:
    """With ``loaded_block_m`` the fused routing puts experts of more than ``block_m``
    pairs in blocks of their own (here 64 rows, an expert of more than 64 in two) and
    the GEMMs run both kinds; every pair is in one block, and the output is the one-kind
    table's, bit for bit (each output is one row's products, whatever the block)."""
    from test_triton_routing import table_groups

    from moetrace.kernels.triton_moe import fused_moe_with_config, moe_config
    from moetrace.kernels.triton_routing import route_and_align

    experts = gpt_oss_experts("mxfp4-fragment", 96, 96, seed=33, num_experts=5)
    gen = torch.Generator().manual_seed(34)
    x = torch.randn(tokens, 96, generator=gen).to(BF16).to(DEVICE)
    logits = torch.randn(tokens, 5, generator=gen)
    logits[:, 1] += 2.0  # expert 1 takes most tokens: past 64 pairs at 90 tokens
    logits = logits.to(DEVICE)
    cfg = moe_config(tokens, 2, 5, mxfp4=True, layout="fragment")
    one = route_and_align(logits, 2, "topk_softmax", cfg.block_m, weights_dtype=BF16)
    two = route_and_align(
        logits, 2, "topk_softmax", cfg.block_m, weights_dtype=BF16, loaded_block_m=64
    )
    assert torch.equal(one.ids, two.ids)
    counts = torch.bincount(two.ids.flatten().long().cpu(), minlength=5)
    kinds = two.aligned, two.aligned.loaded
    groups = [table_groups(kind) for kind in kinds]
    assert [e for e, _ in groups[0]] == [e for e in range(5) if 0 < counts[e] <= 32]
    loaded = [e for e in range(5) if counts[e] > 32]
    assert sorted({e for e, _ in groups[1]}) == loaded
    assert len(groups[1]) == sum((int(counts[e]) + 63) // 64 for e in loaded)
    if tokens == 90:
        assert loaded and max(counts) > 64
    pairs = sorted(p for kind in groups for _, group in kind for p in group)
    assert pairs == list(range(tokens * 2))

    def call(fused) -> torch.Tensor:
        poison_allocator()
        return fused_moe_with_config(
            x, experts.w13, experts.w2, fused.weights, fused.ids, cfg, "clamped_swiglu",
            extras=experts._kernel_extras(), aligned=fused.aligned, weights_f32=fused.weights_f32,
        )  # fmt: skip

    assert torch.equal(call(two), call(one))


def test_fragment_kernel_in_float32() -> None:
    """float32 activations: the generic decoder and exact float32 products."""
    experts = gpt_oss_experts("mxfp4-fragment", 96, 64, seed=13).float()
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(9, 96, generator=gen).to(DEVICE)
    weights, ids = skewed_routing(9, 8, 4, gen)
    plain = experts.forward_torch(x, weights, ids)
    experts.use_triton = True
    err = rel_err(experts(x, weights, ids), plain)
    assert err < TOL[torch.float32], f"relative error {err:.2e}"


@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_fragment_fast_decoder_equals_the_generic_one_in_the_gemms(num_tokens: int) -> None:
    """gpt-oss-20b widths, bf16: the two decoders make the same operands, so the same bits."""
    from moetrace.kernels.triton_moe import fused_moe

    experts = gpt_oss_experts("mxfp4-fragment", 2880, 2880, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(num_tokens, 2880, generator=gen).to(BF16).to(DEVICE)
    weights, ids = skewed_routing(num_tokens, 8, 4, gen)
    extras = experts._kernel_extras()
    assert extras.mxfp4_layout == "fragment" and not extras.mxfp4_wide_scales
    outs = [
        fused_moe(
            x,
            experts.w13,
            experts.w2,
            weights.to(BF16),
            ids,
            activation="clamped_swiglu",
            extras=extras._replace(mxfp4_wide_scales=wide),
        )  # fmt: skip
        for wide in (False, True)
    ]
    assert torch.equal(outs[0], outs[1])


@cuda_only
def test_fragment_kernel_in_float32_at_gpt_oss_widths() -> None:
    experts = gpt_oss_experts("mxfp4-fragment", 2880, 2880, seed=7).float()
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 2880, generator=gen).to(DEVICE)
    weights, ids = skewed_routing(64, 8, 4, gen)
    plain = experts.forward_torch(x, weights, ids)
    experts.use_triton = True
    err = rel_err(experts(x, weights, ids), plain)
    assert err < TOL[torch.float32], f"relative error {err:.2e}"


@cuda_only
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_fragment_and_checkpoint_layouts_agree(num_tokens: int) -> None:
    """The new kernel against the bit decoder (and tl.dot_scaled at prefill) on one model."""
    outs = []
    for layout in ("checkpoint", "fragment"):
        experts = gpt_oss_experts(f"mxfp4-{layout}", 2880, 2880, seed=9)
        experts.use_triton = True
        gen = torch.Generator().manual_seed(10)
        x = torch.randn(num_tokens, 2880, generator=gen).to(BF16).to(DEVICE)
        weights, ids = skewed_routing(num_tokens, 8, 4, gen)
        outs.append(experts(x, weights.to(BF16), ids))
    assert rel_err(outs[1], outs[0].float()) < TOL[BF16] / 3
