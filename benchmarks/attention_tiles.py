"""Decode attention tiles at batch 256, swept under CUDA graphs, to choose ``_tile_configs``.

Each variant is the decode-class launch alone (``q_len == 1``) at one
(BLOCK_N, warps, stages, key splits), replayed from a CUDA graph at batch 256
and the given context, its output checked against the default first.  Also
timed: both classes as a mixed graph launches them (on a decode batch the
prefill class's programs find no work and return), and the prefill class
alone on the same decode batch (what a decode-only graph saves).

    python benchmarks/attention_tiles.py [--shapes qwen3,olmoe,gpt-oss] [--ctx 320]
    TRITON_INTERPRET=1 python benchmarks/attention_tiles.py --smoke   # CPU: runs, times nothing

Variants are compiled first by worker processes (each launches its share
once, so Triton's on-disk cache holds every one), then one process times them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing as mp
import sys
from functools import partial
from typing import NamedTuple

import torch
from kernels import DEV, SMOKE, bench, graphed, paged_batch  # benchmarks/kernels.py

from moetrace.kernels import triton_attention as ta


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    dim: int
    sinks: bool = False
    window: int | None = None


SHAPES = {
    "qwen3": Shape(32, 4, 128),
    "olmoe": Shape(16, 16, 128),
    "gpt-oss": Shape(64, 8, 64, sinks=True),
    "gpt-oss-window": Shape(64, 8, 64, sinks=True, window=128),
}


class Variant(NamedTuple):
    block_n: int
    warps: int
    stages: int
    splits: int


def variants() -> list[Variant]:
    if SMOKE:
        return [Variant(16, 1, 1, 1), Variant(16, 1, 1, 2)]
    return [Variant(*v) for v in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2))]


def build(shape: Shape, batch: int, ctx: int):
    torch.manual_seed(0)
    q, kc, vc, meta = paged_batch(
        [1] * batch, [ctx] * batch, shape.heads, shape.kv_heads, shape.dim
    )
    sinks = torch.randn(shape.heads, dtype=q.dtype, device=DEV) if shape.sinks else None
    return q, kc, vc, meta, sinks


def decode_launch(shape: Shape, built, v: Variant, out: torch.Tensor):
    q, kc, vc, meta, sinks = built
    group = shape.heads // shape.kv_heads
    cfg = ta.TileConfig(max(16, group), v.block_n, v.warps, v.stages)
    return partial(
        ta._launch_class, q, kc, vc, meta, shape.dim**-0.5, shape.window, out, cfg,
        decode=True, decode_max_q=1, num_splits=v.splits, sinks=sinks,
    )  # fmt: skip


def compile_share(args: tuple[list[str], int, int, int, int]) -> int:
    """A worker: launch every ``index % workers == share`` variant once (fills the cache)."""
    names, batch, ctx, share, workers = args
    index = done = 0
    for name in names:
        built = build(SHAPES[name], batch, ctx)
        out = torch.empty_like(built[0])
        for v in variants():
            if index % workers == share:
                try:
                    decode_launch(SHAPES[name], built, v, out)()
                    done += 1
                except Exception:  # does not fit (shared memory): reported when timed
                    pass
            index += 1
    return done


def sweep(name: str, batch: int, ctx: int, hbm_gbs: float, top: int) -> None:
    shape = SHAPES[name]
    built = build(shape, batch, ctx)
    q, kc, vc, meta, sinks = built
    read = min(ctx, shape.window or ctx)
    nbytes = 2 * batch * read * shape.kv_heads * shape.dim * 2
    bound_us = nbytes / hbm_gbs / 1e3
    scale = shape.dim**-0.5
    ref = ta.paged_attention(q, kc, vc, meta, scale, sliding_window=shape.window, sinks=sinks)
    out = torch.empty_like(q)
    print(f"\n{name}: B{batch} ctx{ctx}, {nbytes / 1e6:.1f} MB of KV, {bound_us:.1f} us at "
          f"{hbm_gbs:.0f} GB/s")  # fmt: skip

    def timed(label: str, fn) -> float | None:
        try:
            fn()
            ms = bench(graphed(fn))
        except Exception as exc:
            print(f"  {label:40s} FAILED {type(exc).__name__}: {str(exc)[:100]}")
            return None
        us = ms * 1e3
        print(f"  {label:40s} {us:8.1f} us  {us / bound_us:5.2f}x bound", flush=True)
        return us

    # What a captured step launches: both classes (the graph's metadata allows any mix).
    both_meta = dataclasses.replace(meta, max_query_len=batch, min_query_len=1)
    timed("both classes (a mixed graph's launch)", partial(
        ta.paged_attention, q, kc, vc, both_meta, scale, sliding_window=shape.window,
        sinks=sinks, out=out,
    ))  # fmt: skip
    group = shape.heads // shape.kv_heads
    splits = ta._num_splits(batch, shape.kv_heads, q.device)
    decode_cfg, prefill_cfg = ta._tile_configs(
        group, shape.dim, shape.sinks, batch * shape.kv_heads * splits, ta._num_sms(q.device)
    )
    timed("prefill class alone (no work)", partial(
        ta._launch_class, q, kc, vc, both_meta, scale, shape.window, out, prefill_cfg,
        decode=False,
        decode_max_q=ta.decode_max_q(decode_cfg.block_m, group, splits, decode_cfg.pack),
        sinks=sinks,
    ))  # fmt: skip
    results = []
    for v in variants():
        fn = decode_launch(shape, built, v, out)
        try:
            out.zero_()
            fn()
            diff = (out.float() - ref.float()).abs().max().item()
        except Exception as exc:
            print(f"  {v} FAILED {type(exc).__name__}: {str(exc)[:100]}")
            continue
        if not diff <= 2e-2:
            print(f"  {v} WRONG: max |diff| {diff:.3g}")
            continue
        us = timed(f"N{v.block_n} w{v.warps} s{v.stages} splits {v.splits}", fn)
        if us is not None:
            results.append((us, v))
    results.sort()
    print(f"  best {top} for {name}:")
    for us, v in results[:top]:
        print(f"    {us:8.1f} us  {us / bound_us:5.2f}x  {v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,olmoe,gpt-oss,gpt-oss-window")
    parser.add_argument("--batch", type=int, default=4 if SMOKE else 256)
    parser.add_argument("--ctx", type=int, default=40 if SMOKE else 320)
    parser.add_argument("--workers", type=int, default=0 if SMOKE else 14)
    parser.add_argument("--hbm-gbs", type=float, default=4290.0)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    names = args.shapes.split(",")
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("benchmarks/attention_tiles.py needs CUDA (or --smoke under TRITON_INTERPRET=1)")
    if args.workers > 1:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            pool.map(compile_share, [
                (names, args.batch, args.ctx, i, args.workers) for i in range(args.workers)
            ])  # fmt: skip
    for name in names:
        sweep(name, args.batch, args.ctx, args.hbm_gbs, args.top)


if __name__ == "__main__":
    main()
