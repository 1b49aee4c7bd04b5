"""Attention with sinks rounds where transformers' eager gpt-oss attention rounds.

That reference (``eager_attention_forward`` of ``modeling_gpt_oss``) computes
in the model dtype: scores ``q @ k.T`` rounded, times the scale rounded, the
sink logit joined, the row max subtracted and rounded, a softmax whose
probabilities are rounded *after* dividing by the row's sum, then
``probs @ v`` rounded.  ``emulate`` replays that sequence in float64 with a
rounding to the 16-bit dtype at each of those points; the Triton kernel must
land on it bit for bit except where its float32 sums, in another order, cross
a 16-bit rounding boundary (rare), for prefill, decode and split-K decode,
with and without a sliding window.

On the CPU the interpreter runs the kernel in float16 (Triton 3.6's
interpreter computes bfloat16 dots wrongly); float16 has the same rounding
points, with three more mantissa bits.  Tiny shapes: the interpreter is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from support.triton import DEVICE, INTERPRET, KERNEL_TEST_MARKS  # noqa: E402

from moetrace.forward_context import AttentionMetadata  # noqa: E402
from moetrace.kernels import triton_attention  # noqa: E402
from moetrace.layers.attention import paged_attention_torch  # noqa: E402

pytestmark = KERNEL_TEST_MARKS
DTYPE = torch.float16 if INTERPRET else torch.bfloat16
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 4, 32, 8
SCALE = HEAD_DIM**-0.5  # not a power of two: the product with the scale rounds too


class Step:
    """Packed queries over a paged cache laid out in shuffled blocks, with the dense K/V kept."""

    def __init__(self, q_lens: list[int], seq_lens: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens = q_lens, seq_lens
        need = [math.ceil(s / BLOCK) for s in seq_lens]
        order = torch.randperm(sum(need), generator=gen)
        tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
        shape = (sum(need), BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.full(shape, float("nan"), dtype=DTYPE)
        self.v_cache = torch.full(shape, float("nan"), dtype=DTYPE)
        self.keys, self.values, used = [], [], 0
        for b, s in enumerate(seq_lens):
            tables[b, : need[b]] = order[used : used + need[b]]
            used += need[b]
            # Scores a few units wide: the softmax is far from flat, far from one-hot.
            k = (torch.randn(s, KV_HEADS, HEAD_DIM, generator=gen) * 1.5).to(DTYPE)
            v = torch.randn(s, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
            pos = torch.arange(s)
            slots = tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
            self.k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = k
            self.v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = v
            self.keys.append(k)
            self.values.append(v)
        heads = KV_HEADS * GROUP
        self.q = torch.randn(sum(q_lens), heads, HEAD_DIM, generator=gen).to(DTYPE)
        self.sinks = (torch.randn(heads, generator=gen) * 2).to(DTYPE)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_size=BLOCK,
            query_start_loc_host=starts,
            seq_lens_host=list(seq_lens),
            min_query_len=min(q_lens),
        )

    def kernel(self, window: int | None, splits: int | None = None, pack: int = 1) -> torch.Tensor:
        """The kernel's output; ``splits``: force that split-K factor (decode tiles), and
        ``pack`` KV heads a decode program."""
        q, k, v = (t.to(DEVICE) for t in (self.q, self.k_cache, self.v_cache))
        sinks = self.sinks.to(DEVICE)
        if splits is None:
            out = triton_attention.paged_attention(
                q, k, v, self.meta, SCALE, sliding_window=window, sinks=sinks
            )
        else:
            out = torch.full_like(q, float("nan"))
            triton_attention._launch_attention(
                q, k, v, self.meta, SCALE, window, out, 16, 16, 4, 2, splits, sinks=sinks,
                pack=pack,
            )  # fmt: skip
        return out.cpu()

    def emulate(self, window: int | None, *, normalise_then_round: bool = True) -> torch.Tensor:
        """The reference's rounding sequence in float64.

        ``normalise_then_round=False``: the other order a flash kernel tends to
        use (round each unnormalised ``exp``, divide the weighted sum at the
        end), for the test to show it can tell the two apart.
        """

        def r(x: torch.Tensor) -> torch.Tensor:
            return x.to(DTYPE).double()

        out = torch.empty(self.q.shape, dtype=torch.float64)
        start = 0
        for q_len, s, k, v in zip(self.q_lens, self.seq_lens, self.keys, self.values, strict=True):
            q = self.q[start : start + q_len].double().transpose(0, 1)  # [H, q, D]
            kk = k.double().transpose(0, 1).repeat_interleave(GROUP, 0)
            vv = v.double().transpose(0, 1).repeat_interleave(GROUP, 0)
            scores = r(r(q @ kk.transpose(1, 2)) * torch.tensor(SCALE, dtype=torch.float32).item())
            q_pos = torch.arange(s - q_len, s)[:, None]
            k_pos = torch.arange(s)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= q_pos - k_pos < window
            scores = scores.masked_fill(~visible, float("-inf"))
            sink = self.sinks.double()[:, None, None].expand(-1, q_len, 1)
            combined = torch.cat([scores, sink], dim=-1)
            e = torch.exp(r(combined - combined.amax(-1, keepdim=True)))
            total = e.sum(-1, keepdim=True)
            if normalise_then_round:
                o = r(e / total)[..., :-1] @ vv
            else:
                o = (r(e)[..., :-1] @ vv) / total
            out[start : start + q_len] = r(o).transpose(0, 1)
            start += q_len
        return out.to(DTYPE)

    def plain(self, window: int | None) -> torch.Tensor:
        """The plain-torch path, which runs eager attention's own ops (CPU, this dtype)."""
        return paged_attention_torch(
            self.q, self.k_cache, self.v_cache, self._cpu_meta(), SCALE,
            sliding_window=window, sinks=self.sinks,
        )  # fmt: skip

    def _cpu_meta(self) -> AttentionMetadata:
        m = self.meta
        return AttentionMetadata(
            slot_mapping=m.slot_mapping.cpu(),
            query_start_loc=m.query_start_loc.cpu(),
            seq_lens=m.seq_lens.cpu(),
            block_tables=m.block_tables.cpu(),
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            block_size=m.block_size,
            query_start_loc_host=m.query_start_loc_host,
            seq_lens_host=m.seq_lens_host,
            min_query_len=m.min_query_len,
        )


def same(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of bit-identical elements."""
    return (a == b).float().mean().item()


def assert_close_where_differing(got: torch.Tensor, want: torch.Tensor) -> None:
    """Where they differ, by a rounding step of the outputs' scale (near zero a step
    of a small value is many ulps of it, so the bound is absolute)."""
    step = torch.finfo(DTYPE).eps * want.double().abs().max()
    assert (got.double() - want.double()).abs().max() <= 2 * step


# (query lengths, sequence lengths): prompts with and without a cached prefix; decodes.
PREFILL = ([20, 7, 33], [20, 40, 45])
DECODE = ([1] * 5, [1, 9, 23, 40, 61])


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("lengths", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_kernel_lands_on_the_reference_rounding(window, lengths):
    step = Step(*lengths, seed=3)
    want = step.emulate(window)
    got = step.kernel(window)
    assert same(got, want) > 0.995, same(got, want)
    assert_close_where_differing(got, want)
    # The emulation is the plain path's (and so eager attention's) sequence.
    plain = step.plain(window)
    assert same(plain, want) > 0.995, same(plain, want)
    # Rounding the unnormalised weights instead moves many outputs: the test tells.
    assert same(step.emulate(window, normalise_then_round=False), want) < 0.95


@pytest.mark.parametrize("window", [None, 16])
def test_split_k_decode_lands_on_the_reference_rounding(window):
    """Every split weights its keys by the whole row's probabilities; the merge adds them."""
    step = Step(*DECODE, seed=4)
    want = step.emulate(window)
    for splits in (1, 2, 3):
        got = step.kernel(window, splits)
        assert same(got, want) > 0.995, (splits, same(got, want))
        assert_close_where_differing(got, want)


def test_window_decode_in_one_tile_and_in_three_passes():
    """A window layer's single-query rows see at most ``window`` keys: one tile holds them
    and the kernel rounds from it.  Two- and three-query rows of the same step see more
    and take the three passes; both land on the reference."""
    window = 16
    step = Step([1, 2, 1, 3, 1], [5, 30, 16, 41, 61], seed=6)
    want = step.emulate(window)
    got = step.kernel(window, splits=1)
    assert same(got, want) > 0.995, same(got, want)
    assert_close_where_differing(got, want)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("host_lengths", [True, False], ids=["eager", "graph"])
def test_scores_in_the_pool_are_the_passes_bit_for_bit(window, host_lengths, monkeypatch):
    """Decode sequences with sinks keep their rows' scores in a pool shared by the batch,
    each taking ``q_len`` rows of ``seq_len`` query-keys (rounded up to 8) a head after
    those before it; the ones past the pool's end take the three passes.  The same tiles,
    sums and roundings: the same bits, whichever way a sequence goes.  Shares here: 8,
    48, 24, 40 and 192 (running ends 8, 56, 80, 120, 312), so a pool of 60 holds the
    first two, 120 the first four.  ``graph``: no host lengths (a captured step), the pool
    at its full size."""
    step = Step([1, 2, 1, 1, 3], [7, 20, 23, 40, 61], seed=8)
    if not host_lengths:
        step.meta.query_start_loc_host, step.meta.seq_lens_host = [], []
    want = step.emulate(window)
    monkeypatch.setattr(triton_attention, "SINK_SCORES_POOL", 0)
    passes = step.kernel(window, splits=1)
    for size in (60, 120, 312, 1024):
        monkeypatch.setattr(triton_attention, "SINK_SCORES_POOL", size)
        step.meta.derived.clear()
        got = step.kernel(window, splits=1)
        assert torch.equal(got.view(torch.int16), passes.view(torch.int16)), size
    assert same(passes, want) > 0.995, same(passes, want)
    assert_close_where_differing(passes, want)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("pool", [0, 60, 1024], ids=["passes", "part-pool", "pool"])
def test_packed_kv_heads_give_each_head_its_own_bits(window, pool, monkeypatch):
    """A decode program taking both KV heads (their groups stacked as 8 of the 16 rows,
    their dims side by side) computes each row's scores, sums and weighted values from
    its own head's columns, the other head's adding exact zeros: the bits one KV head
    a program gives, on the one tile, the pool and the passes.  The two- and three-query
    sequences, which a packed decode class leaves to the prefill class, land there on
    the reference."""
    monkeypatch.setattr(triton_attention, "SINK_SCORES_POOL", pool)
    step = Step([1, 2, 1, 1, 3, 1], [7, 20, 23, 40, 61, 33], seed=11)
    single = step.kernel(window, splits=1, pack=1)
    step.meta.derived.clear()
    packed = step.kernel(window, splits=1, pack=2)
    assert torch.equal(packed.view(torch.int16), single.view(torch.int16))
    want = step.emulate(window)
    assert same(packed, want) > 0.995, same(packed, want)
    assert_close_where_differing(packed, want)


SOFTMAX_OPTIONS = [(True, False), (False, True), (True, True)]


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("pool", [0, 60, 1024], ids=["passes", "part-pool", "pool"])
@pytest.mark.parametrize("pack", [1, 2])
@pytest.mark.parametrize(
    "reciprocal, keep_exps", SOFTMAX_OPTIONS, ids=["reciprocal", "keep-exps", "both"]
)
def test_the_faster_softmax_gives_the_division_bits(
    window, pool, pack, reciprocal, keep_exps, monkeypatch
):
    """Each probability from its row's reciprocal and one FMA correction, and the
    exponentials kept in a float32 pool between its last two loops: the bits of the IEEE
    division and of the exponentials computed again, on the one tile, the pool, the
    passes and the prefill class (the two- and three-query rows)."""
    monkeypatch.setattr(triton_attention, "SINK_SCORES_POOL", pool)
    monkeypatch.setattr(triton_attention, "SINK_RECIPROCAL", False)
    monkeypatch.setattr(triton_attention, "SINK_KEEP_EXPS", False)
    step = Step([1, 2, 1, 1, 3, 1], [7, 20, 23, 40, 61, 33], seed=12)
    plain = step.kernel(window, splits=1, pack=pack)
    monkeypatch.setattr(triton_attention, "SINK_RECIPROCAL", reciprocal)
    monkeypatch.setattr(triton_attention, "SINK_KEEP_EXPS", keep_exps)
    step.meta.derived.clear()
    faster = step.kernel(window, splits=1, pack=pack)
    assert torch.equal(faster.view(torch.int16), plain.view(torch.int16))
    assert same(faster, step.emulate(window)) > 0.995


def test_a_split_decode_divides_by_the_reciprocal_alike(monkeypatch):
    """Key splits weigh their keys by the whole row's probabilities, divided the same way."""
    step = Step(*DECODE, seed=4)
    monkeypatch.setattr(triton_attention, "SINK_RECIPROCAL", False)
    plain = step.kernel(None, splits=2)
    monkeypatch.setattr(triton_attention, "SINK_RECIPROCAL", True)
    faster = step.kernel(None, splits=2)
    assert torch.equal(faster.view(torch.int16), plain.view(torch.int16))


@triton.jit
def _share_kernel(e_ptr, total_ptr, out_ptr, COLS: tl.constexpr, FUSED: tl.constexpr):
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    cols = tl.arange(0, COLS)
    e = tl.load(e_ptr + rows[:, None] * COLS + cols[None, :])
    total = tl.load(total_ptr + rows)
    inv = triton_attention._reciprocal(total, True)
    q = triton_attention._share(e, total, inv, True, FUSED)
    tl.store(out_ptr + rows[:, None] * COLS + cols[None, :], q)


def test_the_reciprocal_share_rounds_as_ieee_division():
    """``_share`` on sums and exponentials of a softmax's ranges (a row's sum from 1 to
    2**20, its exponentials from 2**-100 to 1), with a third of the quotients placed a
    hair from halfway between two float32s, where a quotient a rounding step off would
    round the other way: float32's division, bit for bit (the GPU's FMA, or the
    interpreter's float64 stand-in for it)."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 64, 256
    total = torch.exp2(torch.rand(rows, generator=gen, dtype=torch.float64) * 20).float()
    e = torch.exp2(-torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 100).float()
    # Quotients near a midpoint m of two float32s: e = m * total, rounded to float32.
    q = (e.double() / total.double()[:, None]).float().double()
    ulp = torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(q)))
    hard = ((q + ulp / 2) * total.double()[:, None]).float()
    e[:, ::3] = hard.clamp(max=1.0)[:, ::3]
    want = e / total[:, None]  # IEEE division, on either device
    out = torch.empty(rows, cols, device=DEVICE)
    _share_kernel[(rows // 16,)](
        e.to(DEVICE), total.to(DEVICE), out, COLS=cols, FUSED=DEVICE.type == "cuda"
    )
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))
    # The test tells: a plain product by the reciprocal misses some of them.
    assert not torch.equal((e * (1 / total)[:, None]).view(torch.int32), want.view(torch.int32))


def test_decode_tiles_pack_kv_heads_only_where_they_fit(monkeypatch):
    """Sinks' decode tiles pack KV heads up to ``SINK_DECODE_PACK`` and the 16 rows, but for
    a window layer's one tile; the launch takes fewer where the heads do not divide, or
    under key splits, or with heads apart in the cache."""
    monkeypatch.setattr(triton_attention, "SINK_DECODE_PACK", 4)
    cfg = triton_attention._tile_configs(8, 64, True, 256 * 8, 132)[0]  # gpt-oss-20b
    assert cfg.pack == 2 and cfg.block_m == 16
    assert triton_attention._tile_configs(8, 128, False, 256 * 4, 132)[0].pack == 1
    # A window layer's one tile stays unpacked (its registers).
    assert triton_attention._tile_configs(8, 64, True, 256 * 8, 132, one_tile=True)[0].pack == 1
    monkeypatch.setattr(triton_attention, "SINK_DECODE_PACK", 1)
    assert triton_attention._tile_configs(8, 64, True, 256 * 8, 132)[0].pack == 1
    cache = torch.empty(4, BLOCK, 6, HEAD_DIM)
    fit = triton_attention._fitting_pack
    assert fit(4, 1, cache, cache) == 2
    assert fit(2, 2, cache, cache) == 1
    apart = torch.empty(4, BLOCK, HEAD_DIM, 6).transpose(2, 3)
    assert fit(2, 1, apart, apart) == 1


def test_pool_shares_follow_the_decode_sequences():
    """Each sequence's end in the pool is the running sum of ``q_len`` rows of ``seq_len``
    rounded up to 8 over the decode class (queries of up to ``decode_max_q``); a longer
    query takes no share."""
    step = Step([1, 2, 5, 1, 3], [7, 20, 23, 40, 61], seed=9)
    ends = triton_attention._pool_ends(step.meta, 4).cpu().tolist()
    assert ends == [8, 56, 56, 96, 288]
    assert triton_attention._pool_size(step.meta, 4) == 288
    assert triton_attention._pool_ends(step.meta, 4) is triton_attention._pool_ends(step.meta, 4)


def test_each_sequence_keeps_its_scores_in_its_own_share(monkeypatch):
    """The pool after a launch, read back: sequence ``s``'s share starts at its running
    end minus ``q_len`` rows (times the heads), then KV head, tile row (query, head) and
    key, each row ``seq_len`` keys rounded up to 8 long, holding eager attention's
    rounded scores (-inf where a query does not see the key) and nothing past its keys.
    The shares tile the pool with no gap and no overlap, so every key's element is
    written once, by its own sequence."""
    step = Step([1, 2, 1], [7, 20, 23], seed=11)
    pools = []
    real_empty = torch.empty

    def keep_pool(*args, **kwargs):
        made = real_empty(*args, **kwargs)
        if made.dim() == 1:  # the pool: the only 1-D buffer a launch makes
            made.fill_(float("nan"))
            pools.append(made)
        return made

    monkeypatch.setattr(triton_attention.torch, "empty", keep_pool)
    step.kernel(None, splits=1)
    (pool,) = pools
    pool = pool.cpu().double()
    heads = KV_HEADS * GROUP
    assert pool.numel() == (1 * 8 + 2 * 24 + 1 * 24) * heads
    end = 0
    for q_len, s, k, q in zip(
        step.q_lens, step.seq_lens, step.keys, step.q.split(step.q_lens), strict=True
    ):
        row = -(-s // 8) * 8
        share = q_len * row
        end += share
        scores = q.double().transpose(0, 1) @ k.double().permute(1, 2, 0).repeat_interleave(
            GROUP, 0
        )
        scores = (scores.to(DTYPE) * torch.tensor(SCALE, dtype=torch.float32).item()).to(DTYPE)
        hidden = torch.arange(s)[None, :] > torch.arange(s - q_len, s)[:, None]  # [q, keys]
        scores = scores.double().masked_fill(hidden, float("-inf"))  # [heads, q, keys]
        for kv_head in range(KV_HEADS):
            base = (end - share) * heads + kv_head * GROUP * share
            got = pool[base : base + GROUP * share].view(q_len, GROUP, row)  # query, head
            group = scores[kv_head * GROUP : (kv_head + 1) * GROUP].transpose(0, 1)
            assert torch.equal(got[..., :s], group), (s, kv_head)
            assert got[..., s:].isnan().all(), (s, kv_head)
    assert end * heads == pool.numel()


def test_a_long_row_keeps_its_scores_in_the_pool(monkeypatch):
    """A row longer than any fixed per-row scratch would hold (here 150 keys) keeps its
    scores when the batch's shares fit, beside short rows: the passes' bits."""
    step = Step([1, 1, 1], [3, 150, 9], seed=10)
    monkeypatch.setattr(triton_attention, "SINK_SCORES_POOL", 0)
    passes = step.kernel(None, splits=1)
    monkeypatch.setattr(triton_attention, "SINK_SCORES_POOL", 1024)
    step.meta.derived.clear()
    got = step.kernel(None, splits=1)
    assert torch.equal(got.view(torch.int16), passes.view(torch.int16))
    want = step.emulate(None)
    assert same(got, want) > 0.995, same(got, want)


def test_the_kv_sizing_sets_the_scratch_aside(tmp_path):
    """A batch of decodes takes the scores pool that one long sequence (the profiling
    forward) does not: the KV cache's sizing sets it aside for models with sinks only."""
    pytest.importorskip("transformers")
    from support.hf_reference import make_tiny_checkpoint

    from moetrace.engine.memory import decode_scratch_bytes
    from moetrace.models.loader import load_model

    for family, sinks in (("gpt_oss", True), ("qwen3_moe", False)):
        ckpt = make_tiny_checkpoint(family, tmp_path / family, seed=1, dtype=torch.float16)
        model = load_model(str(ckpt), device="cpu", dtype="float16").model
        layer = next(model.attention_layers())
        want = triton_attention.sink_scratch_bytes(layer.num_heads, 2)
        assert decode_scratch_bytes(model) == (want if sinks else 0)
        assert want == layer.num_heads * triton_attention.SINK_SCORES_POOL * 2
