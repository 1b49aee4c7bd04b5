"""Decode-step kernels timed in steady state: many calls chained in one CUDA graph.

    python benchmarks/steady_state.py [align] [attention] [splits] [sinks] [gemms] [splitk] [streams]
        [regs] [regs-batches] [sink-tiles] [sink-softmax] [qwen3-stages] [warm]

``align``: ``align_routing`` at T=256 and 8192 for the OLMoE-1B-7B, Qwen3-30B-A3B
and DeepSeek-V2-Lite routings, the planning kernel on 1 to 16 programs.
``attention``: decode attention at batch 256 (contexts 320 and 1024) on
``attention_tiles.py``'s shapes, chained and, beside it, one graph replay timed
by ``do_bench`` (what ``attention_tiles.py`` reports), to show what the single
replay adds.
``splits``: the same decode attention chained with its keys in 1, 2 and 4 splits
(the decode class's split-K, merged by a second launch), whatever
``triton_attention._num_splits`` would pick: at batch 256 a Qwen3-30B-A3B
layer has 1,024 (sequence, KV head) programs, about two waves, so a split
trades the second wave's fill and drain for the merge.
``sinks``: gpt-oss-20b's decode attention (full layers at contexts 320 to 16,384,
window layers at 320), its rows' scores kept in the batch's pool of
``triton_attention.SINK_SCORES_POOL`` query-keys a head (K read once; the
sequences past its end take the passes) against the three passes over K.
``gemms``: the decode step's projection GEMMs at M=256 (``projection_gemms.py``'s
shapes) under each BLAS library torch offers
(``torch.backends.cuda.preferred_blas_library``).
``splitk``: the same projections (and gpt-oss-20b's q/k/v and o) through
``F.linear`` against one strided-batched GEMM over 2 or 4 shares of K with
float32 outputs, which the next kernel would have to sum: whether more
programs shorten them.
``streams``: four MoE layers' experts at T=256 (``moe_tiles.py``'s OLMoE-1B-7B,
Qwen3-30B-A3B, DeepSeek-V2-Lite and fragment-MXFP4 gpt-oss shapes; alignment,
gate/up, down), chained on one stream, with each layer's row blocks in two or
three parts side by side (``kernels/side_streams.py``), and whole layers in
pairs on two streams: what the extra streams win is the time a layer's
kernels lose where one drains and the next fills.
``regs``: decode attention (Qwen3-30B-A3B and OLMoE-1B-7B at batch 256, contexts 320
and 1,024) on 64- and 32-key tiles with register caps, for more programs a multiprocessor
(Qwen3's 1,024 programs fill about two waves at four).
``regs-batches``: Qwen3-30B-A3B's decode attention at batches 32-192 and contexts 320
to 4,096, the tile ``_tile_configs`` picks against the capped 32-key tile at any split.
``sink-tiles``: gpt-oss-20b's decode attention (full layers at contexts 320, 1,024 and
4,096, window layers at 320) on decode tiles of 32 or 64 keys, 4 or 8 warps, 2-3 stages,
register caps, and one or two KV heads a program.
``sink-softmax``: the same four cases with the sinks' softmax the default way, by each
row's reciprocal (``SINK_RECIPROCAL``) and with the exponentials kept in a float32 pool
as well (``SINK_KEEP_EXPS``), on one and on two KV heads a program.
``qwen3-stages``: Qwen3-30B-A3B's decode attention at batch 256 on the capped 32-key
tile with 2-4 stages, and on 16-key tiles: whether more loads in flight shorten it.
``warm``: whether L2 keeps what a kernel read for the kernel after it (a buffer of
8-40 MB read cold, then read again after a warming read), and whether warming the
first experts' gate/up weights during a layer's small kernels, when HBM idles,
shortens the experts' GEMMs after them: each layer a 160 MB read (standing in
for attention's KV), a one-program spin (the small kernels), then the experts,
with and without a warming read of the first 16-48 MB of ``w13`` forked beside
the spin.

Times are µs a call from ``graph_replay.chained_us``: each chain rotates its
inputs through more bytes than the L2 holds, so every call reads from HBM as
it would in a step.
"""

from __future__ import annotations

import sys
from functools import partial

import attention_tiles
import graph_replay
import moe_tiles
import projection_gemms
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernels import bench, graphed  # benchmarks/kernels.py

from moetrace.kernels import triton_align, triton_attention, triton_moe
from moetrace.kernels.side_streams import run_beside


def align() -> None:
    for name, (experts, top_k, block_m) in {
        "olmoe-1b-7b": (64, 8, 64),
        "qwen3-30b-a3b": (128, 8, 32),
        "deepseek-v2-lite": (64, 6, 64),
    }.items():
        for tokens in (256, 8192):
            picks = [torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]
            ids = torch.stack(picks).to(torch.int32)
            row = []
            default = triton_align._PLAN_PROGRAMS
            try:
                for programs in (1, 4, 8, 16):
                    triton_align._PLAN_PROGRAMS = programs
                    calls = [partial(triton_align.align_routing, ids, experts, block_m)] * 24
                    row.append(f"{programs:2d} programs {graph_replay.chained_us(calls):6.1f}")
            finally:
                triton_align._PLAN_PROGRAMS = default
            print(f"align {name:17s} T={tokens:<5d} " + "  ".join(row), flush=True)


def _attention_calls(shape, ctx: int, batch: int = 256) -> tuple[list, float]:
    """Decode attention calls at ``batch`` sequences of context ``ctx`` whose KV together
    pass the L2, and the µs one call's KV takes at the HBM bound."""
    kv_bytes = 2 * batch * min(ctx, shape.window or ctx) * shape.kv_heads * shape.dim * 2
    copies = max(1, -(-150_000_000 // kv_bytes))
    batches = [attention_tiles.build(shape, batch, ctx) for _ in range(copies)]
    calls = []
    for i in range(max(8, copies)):
        q, kc, vc, meta, sinks = batches[i % copies]
        calls.append(partial(
            triton_attention.paged_attention, q, kc, vc, meta, shape.dim**-0.5,
            sliding_window=shape.window, sinks=sinks, out=torch.empty_like(q),
        ))  # fmt: skip
    return calls, kv_bytes / projection_gemms.HBM_BYTES_S * 1e6


def _attention_variants(section: str, cases, name: str | tuple, variants: dict) -> None:
    """Decode attention at each ``(shape name, context[, batch])`` of ``cases`` (batch 256
    unless given), chained once per variant: ``triton_attention.<name>`` set to each value
    of ``variants`` (label: value; several names take a tuple of values), restored
    afterwards."""
    names = name if isinstance(name, tuple) else (name,)
    defaults = {n: getattr(triton_attention, n) for n in names}
    try:
        for shape_name, ctx, *batch in cases:
            batch = batch[0] if batch else 256
            calls, bound = _attention_calls(attention_tiles.SHAPES[shape_name], ctx, batch)
            row = []
            for label, value in variants.items():
                values = value if isinstance(name, tuple) else (value,)
                for n, v in zip(names, values, strict=True):
                    setattr(triton_attention, n, v)
                row.append(f"{label} {graph_replay.chained_us(calls):6.1f}")
            print(
                f"{section} {shape_name:15s} B {batch:3d} ctx {ctx:5d} (bound {bound:6.1f} us): "
                + "  ".join(row),
                flush=True,
            )
    finally:
        for n, v in defaults.items():
            setattr(triton_attention, n, v)


def splits() -> None:
    cases = [(name, ctx) for name in attention_tiles.SHAPES for ctx in (320, 1024)]
    variants = {f"{n} split{'s' if n > 1 else ' '}": lambda *_, n=n: n for n in (1, 2, 4)}
    _attention_variants("splits", cases, "_num_splits", variants)


def _decode_tile(tile: triton_attention.TileConfig):
    """A stand-in for ``_tile_configs`` that decodes on ``tile`` and keeps the prefill tile
    the real one picks (taken now, before ``_attention_variants`` swaps it out)."""
    default = triton_attention._tile_configs
    return lambda *shape, **kinds: (tile, default(*shape, **kinds)[1])


def _decode_tiles(tiles) -> dict:
    """``_attention_variants`` variants from (key tile, warps, stages, register cap[, KV
    heads a program]) tuples, each on a 16-row decode tile."""
    variants = {}
    for n, warps, stages, reg, *pack in tiles:
        tile = triton_attention.TileConfig(16, n, warps, stages, reg, *pack)
        label = f"N{n} w{warps} s{stages} r{reg or '-'} p{tile.pack}"
        variants[label] = _decode_tile(tile)
    return variants


def regs() -> None:
    cases = [(name, ctx) for name in ("qwen3", "olmoe") for ctx in (320, 1024)]
    tiles = [(64, None), (64, 96), (64, 80), (32, None), (32, 80), (32, 64)]
    variants = {
        f"N{n} r{reg or '-'}": _decode_tile(triton_attention.TileConfig(16, n, 4, 2, reg))
        for n, reg in tiles
    }
    _attention_variants("regs", cases, "_tile_configs", variants)


def regs_batches() -> None:
    """Qwen3's decode attention below batch 256: the tile ``_tile_configs`` picks (since
    this section's first run, the capped tile wherever the swept one takes two waves)
    against the 32-key tile capped at 64 registers at every batch."""
    cases = [("qwen3", ctx, b) for ctx in (320, 1024, 4096) for b in (32, 64, 96, 128, 160, 192)]
    variants = {
        "default": triton_attention._tile_configs,
        "N32 r64": _decode_tile(triton_attention.TileConfig(16, 32, 4, 2, 64)),
    }
    _attention_variants("regs-batches", cases, "_tile_configs", variants)


def sinks() -> None:
    contexts = (320, 1024, 2048, 4096, 8192, 16384)
    cases = [("gpt-oss", ctx) for ctx in contexts] + [("gpt-oss-window", 320)]
    size = triton_attention.SINK_SCORES_POOL
    variants = {"three passes": 0, f"pool of {size:,} query-keys": size}
    _attention_variants("sinks", cases, "SINK_SCORES_POOL", variants)


def sink_tiles() -> None:
    """gpt-oss-20b's decode attention (sinks; full layers through the scores pool, window
    layers on their one tile) at batch 256 on several decode tiles: key tile, warps,
    stages, register cap and KV heads a program."""
    cases = [("gpt-oss", ctx) for ctx in (320, 1024, 4096)] + [("gpt-oss-window", 320)]
    tiles = [
        (64, 4, 2, None, 1), (64, 4, 2, 80, 1), (64, 4, 2, 72, 1), (64, 4, 2, 64, 1),
        (64, 4, 2, None, 2), (32, 4, 2, None, 2),
        (32, 4, 3, None, 2), (32, 8, 2, None, 2), (64, 8, 2, None, 2), (64, 4, 2, 96, 2),
        (32, 4, 2, 64, 2),
    ]  # fmt: skip
    _attention_variants("sink-tiles", cases, "_tile_configs", _decode_tiles(tiles))


def sink_softmax() -> None:
    """gpt-oss-20b's decode attention at batch 256 with the sinks' softmax done the
    default way and the faster ways (``SINK_RECIPROCAL``, ``SINK_KEEP_EXPS``), on one KV
    head a program and on two: the same bits, fewer instructions, some more bytes."""
    cases = [("gpt-oss", ctx) for ctx in (320, 1024, 4096)] + [("gpt-oss-window", 320)]
    names = ("_tile_configs", "SINK_RECIPROCAL", "SINK_KEEP_EXPS")
    variants = {}
    for pack in (1, 2):
        (tile,) = _decode_tiles([(64, 4, 2, None, pack)]).values()
        for label, reciprocal, keep in (("", False, False), (" rcp", True, False),
                                        (" rcp+keep", True, True)):  # fmt: skip
            variants[f"p{pack}{label}"] = (tile, reciprocal, keep)
    _attention_variants("sink-softmax", cases, names, variants)


def qwen3_stages() -> None:
    """Qwen3-30B-A3B's decode attention at batch 256 on the capped 32-key tile and its
    neighbours: more stages in flight, 16-key tiles, other caps."""
    cases = [("qwen3", ctx) for ctx in (320, 1024)]
    tiles = [
        (32, 4, 2, 64), (32, 4, 3, 64), (32, 4, 4, 64), (16, 4, 2, 64), (16, 4, 3, 64),
        (16, 4, 4, 64), (32, 4, 3, 56), (32, 2, 2, 128), (32, 2, 3, 128), (64, 4, 3, 64),
    ]  # fmt: skip
    _attention_variants("qwen3-stages", cases, "_tile_configs", _decode_tiles(tiles))


def attention() -> None:
    for name, shape in attention_tiles.SHAPES.items():
        for ctx in (320, 1024):
            calls, bound = _attention_calls(shape, ctx)
            chained = graph_replay.chained_us(calls)
            single = bench(graphed(calls[0])) * 1e3
            print(
                f"attention {name:15s} ctx {ctx:4d}: chained {chained:6.1f} us ({chained / bound:.2f}x"
                f" of {bound:.1f}), one replay by do_bench {single:6.1f} us",
                flush=True,
            )


def _projection_chain(name: str, k: int, n: int) -> tuple[list, list[str]]:
    """24 calls of ``F.linear(x, w)`` at M=256 rotating through weights that pass the L2, and
    the table row's head (the shape and its bytes' time)."""
    copies = int(200e6 // (k * n * 2)) + 2
    weights = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(projection_gemms.TOKENS, k, device="cuda").to(torch.bfloat16)
    calls = [partial(F.linear, x, weights[i % copies]) for i in range(24)]
    return calls, [f"{name:12s} bytes {k * n * 2 / projection_gemms.HBM_BYTES_S * 1e6:5.1f} us"]


def gemms() -> None:
    for name, (k, n) in projection_gemms.SHAPES.items():
        calls, row = _projection_chain(name, k, n)
        for library in ("default", "cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            row.append(f"{library} {graph_replay.chained_us(calls):5.1f}")
        torch.backends.cuda.preferred_blas_library("default")
        print("  ".join(row), flush=True)


# The step's projections (``projection_gemms.py``'s, routers aside) and gpt-oss-20b's.
SPLIT_K_SHAPES = {
    **{name: kn for name, kn in projection_gemms.SHAPES.items() if "router" not in name},
    "gpt-oss qkv": (2880, 5120),
    "gpt-oss o": (4096, 2880),
}


def _split_k(x: torch.Tensor, w: torch.Tensor, shares: int) -> torch.Tensor:
    """``x @ w.T`` as ``shares`` float32 partial products over slices of K, one
    strided-batched GEMM (the next kernel would sum them)."""
    (m, k), n = x.shape, w.shape[0]
    xs = x.view(m, shares, k // shares).transpose(0, 1)
    ws = w.view(n, shares, k // shares).permute(1, 2, 0)
    return torch.bmm(xs, ws, out_dtype=torch.float32)


def splitk() -> None:
    for name, (k, n) in SPLIT_K_SHAPES.items():
        calls, row = _projection_chain(name, k, n)
        row.append(f"F.linear {graph_replay.chained_us(calls):5.1f}")
        for shares in (2, 4):
            split = [partial(_split_k, *call.args, shares) for call in calls]
            row.append(f"{shares} shares of K {graph_replay.chained_us(split):5.1f}")
        print("  ".join(row), flush=True)


def _side_by_side_us(calls: list) -> float:
    """µs a call with ``calls`` captured in pairs, each pair's two on two forked streams."""
    side = [torch.cuda.Stream(), torch.cuda.Stream()]

    def pairs() -> None:
        main = torch.cuda.current_stream()
        for i in range(0, len(calls), 2):
            for stream, call in zip(side, calls[i : i + 2], strict=True):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    call()
            for stream in side:
                main.wait_stream(stream)

    return graph_replay.replayed_us(graph_replay.graphed(pairs), len(calls))


def _experts_calls(shape, layers) -> list:
    """One ``fused_moe`` call a layer at the shape's default tile (MXFP4: its extras)."""
    cfg = triton_moe.moe_config(
        256, shape.top_k, shape.experts, mxfp4=shape.fmt == "mxfp4", layout=shape.layout
    )
    calls = []
    for experts, x, weights, ids, _ in layers:
        extras = experts._kernel_extras() if shape.activation == "clamped_swiglu" else None
        calls.append(
            partial(
                triton_moe.fused_moe_with_config,
                x,
                experts.w13,
                experts.w2,
                weights,
                ids,
                cfg,
                shape.activation,
                extras=extras,
                combine=False,
            )  # fmt: skip
        )
    return calls


def streams() -> None:
    for name in ("olmoe", "qwen3", "deepseek-v2-lite", "gpt-oss-mx-frag"):
        shape = moe_tiles.SHAPES[name]
        layers = [moe_tiles.build(shape, 256, seed=seed) for seed in range(4)]
        calls = _experts_calls(shape, layers)
        nbytes = sum(layer[4] for layer in layers) / len(layers)
        chained = {}
        defaults = triton_moe.EXPERT_STREAMS, triton_moe.FRAGMENT_STREAMS
        for parts in (1, 2, 3):  # each call's experts in 1-3 parts on as many streams
            triton_moe.EXPERT_STREAMS = triton_moe.FRAGMENT_STREAMS = parts
            chained[parts] = graph_replay.chained_us(calls)
        triton_moe.EXPERT_STREAMS = triton_moe.FRAGMENT_STREAMS = 1
        two = _side_by_side_us(calls)
        triton_moe.EXPERT_STREAMS, triton_moe.FRAGMENT_STREAMS = defaults
        print(
            f"streams {name:17s} bytes {nbytes / projection_gemms.HBM_BYTES_S * 1e6:6.1f} us"
            f"  one stream {chained[1]:6.1f}  in 2 parts {chained[2]:6.1f}"
            f"  in 3 parts {chained[3]:6.1f}  layers in pairs {two:6.1f} (us a layer)",
            flush=True,
        )
        del layers, calls
        torch.cuda.empty_cache()


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, CHUNK: tl.constexpr, KEEP: tl.constexpr):
    """Every program reads its share of ``src`` (int32 words) in ``CHUNK``-word steps and
    stores what it read, folded by xor and summed, so that no load is dropped.  ``KEEP``:
    the loads ask L2 to keep their lines (``evict_last``)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * CHUNK
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(pid * CHUNK, n_words, step):
        offs = start + tl.arange(0, CHUNK)
        if KEEP:
            acc ^= tl.load(
                src_ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_last"
            )
        else:
            acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _spin_kernel(out_ptr, iterations):
    """One program's dependent chain of multiplies: a stand-in for a layer's small kernels
    that leaves the other multiprocessors, and HBM, free."""
    x = tl.load(out_ptr).to(tl.float32) + 1.0
    for _ in range(iterations):
        x = x * 0.9999999 + 1e-7
    tl.store(out_ptr, x.to(tl.int32))


def _read(buf: torch.Tensor, out: torch.Tensor, programs: int, keep: bool = False) -> None:
    words = buf.view(torch.int32).view(-1)
    _read_kernel[(programs,)](words, out, words.numel(), CHUNK=4096, KEEP=keep, num_warps=8)


def warm() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(4 * sms, dtype=torch.int32, device="cuda")
    flush = torch.empty(160 << 20, dtype=torch.uint8, device="cuda")
    for mb in (8, 16, 24, 32, 40, 48):
        buf = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        cold = graph_replay.chained_us(
            [partial(_read, flush, out, sms), partial(_read, buf, out, sms)] * 4
        )
        flushed = graph_replay.chained_us([partial(_read, flush, out, sms)] * 8)
        times = {}
        for keep in (False, True):
            calls = [partial(_read, flush, out, sms), partial(_read, buf, out, 32, keep),
                     partial(_read, buf, out, sms)]  # fmt: skip
            warmed = graph_replay.chained_us(calls * 4) * 3
            alone = graph_replay.chained_us(calls[:2] * 4) * 2
            times[keep] = warmed - alone
        read_cold = 2 * cold - flushed
        print(
            f"warm L2 {mb:2d} MB: read cold {read_cold:6.1f} us (HBM {mb / 4.29e6 * (1 << 20):5.1f})"
            f"  after a warming read {times[False]:6.1f}  after one kept (evict_last) {times[True]:6.1f}",
            flush=True,
        )
    spin = torch.zeros(1, dtype=torch.int32, device="cuda")
    for name in ("qwen3", "olmoe"):
        shape = moe_tiles.SHAPES[name]
        layers = [moe_tiles.build(shape, 256, seed=seed) for seed in range(4)]
        steps = partial(_warm_steps, layers, _experts_calls(shape, layers), flush, out, spin)
        spin_us = graph_replay.chained_us([partial(_spin_kernel[(1,)], spin, 12_000)] * 8)
        base = graph_replay.chained_us(steps(0, 0, False, with_experts=False))
        row = [f"spin {spin_us:5.1f}, read+spin {base:6.1f}"]
        for warm_mb, programs, keep in [(0, 0, False), (16, 32, True), (32, 32, True), (48, 32, True),
                                        (32, 16, True), (32, 64, True), (32, 32, False)]:  # fmt: skip
            t = graph_replay.chained_us(steps(warm_mb, programs, keep))
            row.append(f"warm {warm_mb} MB/{programs}p{'/keep' if keep else ''} {t - base:6.1f}")
        print(f"warm {name:6s} experts a layer (us): " + "  ".join(row), flush=True)
        del layers, steps
        torch.cuda.empty_cache()


def _warm_steps(
    layers, experts_calls, flush, out, spin, warm_mb, programs, keep, with_experts=True
):
    """A layer's stand-in calls each: the 160 MB read, the spin with (``warm_mb``) a read of
    the first ``w13`` bytes on ``programs`` programs forked beside it, then the experts."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    calls = []
    for (experts, *_), experts_call in zip(layers, experts_calls, strict=True):
        w13 = experts.w13.view(-1).view(torch.uint8)[: warm_mb << 20]
        beside_spin = [partial(_spin_kernel[(1,)], spin, 12_000)]
        if warm_mb:
            beside_spin.append(partial(_read, w13, out[sms:], programs, keep))

        def step(beside_spin=beside_spin, experts_call=experts_call) -> None:
            _read(flush, out, sms)
            run_beside(beside_spin, flush.device)
            if with_experts:
                experts_call()

        calls.append(step)
    return calls


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/steady_state.py needs CUDA")
    sections = {
        "align": align, "attention": attention, "splits": splits, "sinks": sinks,
        "gemms": gemms, "splitk": splitk, "streams": streams, "warm": warm,
        "regs": regs, "regs-batches": regs_batches, "sink-tiles": sink_tiles,
        "sink-softmax": sink_softmax, "qwen3-stages": qwen3_stages,
    }  # fmt: skip
    for name in sys.argv[1:] or list(sections):
        if name not in sections:
            sys.exit(f"unknown section {name!r}: choose from {', '.join(sections)}")
        sections[name]()


if __name__ == "__main__":
    main()
