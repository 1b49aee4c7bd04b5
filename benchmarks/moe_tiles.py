"""Sweep the fused-MoE kernels' tile configs at the decode step's shape, per family.

    PYTHONPATH=. python3 benchmarks/moe_tiles.py [--tokens 256] [--shapes olmoe,gpt-oss-mx]
    PYTHONPATH=. python3 benchmarks/moe_tiles.py --shapes gpt-oss-mx-bits,gpt-oss-mx-frag

For each shape (a family's experts at batch ``--tokens``, top-k routing drawn
at random) every config of the grid runs as a CUDA-graph replay (as the
engine's decode does) and is timed with ``triton.testing.do_bench``; the
table gives each config's time, its GB/s over the expert weights that got
tokens, and how far it is from the HBM bound (``--hbm-gbs``).  Compilation is
done first by worker processes in parallel (each launches its share once, so
Triton's on-disk cache holds every variant), then one process times them all:
a sweep of hundreds of variants fits in a few minutes.

MXFP4 shapes: ``gpt-oss-mx`` (checkpoint layout, ``tl.dot_scaled``),
``gpt-oss-mx-bits`` (checkpoint layout, the kernel's bit decoder) and
``gpt-oss-mx-frag`` (the fragment layout of ``kernels/mxfp4_layout.py``, whose
``block_n`` counts weight rows).  Run together, the last lines compare each
shape's best with the first shape's.  ``--tiles 32,128,128,8,4,3 ...`` times
only the tiles given (block_m, block_n, block_k, group_m, warps, stages and,
optionally, the loaded experts' block, 0 for none, then a register cap, 0 for
none; the rest as the shape's default), for comparing trees or layouts side by side.

A config with ``loaded_block_m`` (the fragment default from 32 rows an
expert) runs as the engine runs it: the pairs grouped by the fused routing
kernel, in two kinds of block, the routing's launch inside the timed call
(where the others time ``align_routing``'s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
from dataclasses import dataclass
from pathlib import Path

import graph_replay
import torch

from moetrace.kernels import triton_moe as tm
from moetrace.kernels.triton_routing import route_and_align
from moetrace.layers.moe import MoEExperts


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    fmt: str = "dense"  # or "mxfp4"
    native: bool | None = None  # MXFP4 decoder: tl.dot_scaled (True) or bit arithmetic
    layout: str = "checkpoint"  # MXFP4 layout (kernels/mxfp4_layout.py)

    @property
    def activation(self) -> str:
        return "clamped_swiglu" if self.name.startswith("gpt-oss") else "silu"


SHAPES = {
    s.name: s
    for s in [
        Shape("olmoe", 64, 8, 2048, 1024),
        Shape("qwen3", 128, 8, 2048, 768),
        Shape("deepseek-v2-lite", 64, 6, 2048, 1408),
        Shape("gpt-oss-bf16", 32, 4, 2880, 2880),
        Shape("gpt-oss-mx", 32, 4, 2880, 2880, "mxfp4", True),
        Shape("gpt-oss-mx-bits", 32, 4, 2880, 2880, "mxfp4", False),
        Shape("gpt-oss-mx-frag", 32, 4, 2880, 2880, "mxfp4", None, "fragment"),
    ]
}


def fragment_grid(decode: bool) -> list[tm.MoEConfig]:
    """Fragment-layout MXFP4: token blocks 16-64 (the MMA's N), 64, 128 or 256 weight rows
    over 4 or 8 warps, K steps of 128 or 256, 2-4 stages, register caps; prefill: token
    blocks of 64 and 128.

    The 64-row tiles (one warpgroup's product) compiled for the H200 take 89-98 registers
    with 32 tokens (five programs a multiprocessor, where the default's 160-163 fit three)
    and 132-144 with 64 (each weight decoded once an expert at batch 256).
    """
    if decode:
        shapes = [(bm, bn, w) for bm in (32, 64) for bn, w in ((128, 4), (128, 8), (256, 8))]
        shapes += [(16, 128, 4), (32, 64, 4), (64, 64, 4)]
        tiles = [
            tm.MoEConfig(bm, bn, bk, 8, w, st, mxfp4_native=False)
            for (bm, bn, w), bk, st in itertools.product(shapes, (128, 256), (2, 3, 4))
            if not (bk == 256 and bn == 256)  # past the registers
        ]
        # Register caps on the 4-warp tiles: 128 keeps 4 programs a multiprocessor now that
        # the products stay in flight (more registers live), 96 lets 5 share one, 80 six (a
        # few spills to local memory, cached in L1).
        return tiles + [
            tm.MoEConfig(bm, 128, 128, 8, 4, st, mxfp4_native=False, maxnreg=reg)
            for bm, st, reg in itertools.product((16, 32), (2, 3), (128, 96, 80))
        ]
    return [
        tm.MoEConfig(bm, bn, 128, 8, w, 3, mxfp4_native=False)
        for bm in (64, 128)
        for bn, w in ((128, 4), (128, 8), (256, 8))
    ]


def grid(shape: Shape, tokens: int) -> list[tm.MoEConfig]:
    """Decode: row blocks of 16-64, K steps as wide as MXFP4's bytes allow; prefill: 64-128."""
    if shape.layout == "fragment":
        return fragment_grid(tokens * shape.top_k / shape.experts <= 160)
    if tokens * shape.top_k / shape.experts <= 160:
        blocks_m, stages = (16, 32, 64), (3, 4)
        ks = (128, 256, 512) if shape.fmt == "mxfp4" else (64, 128, 256)
    else:
        blocks_m, stages, ks = (64, 128), (3,), (64, 128)
    return [
        tm.MoEConfig(bm, bn, bk, 8, warps, st)
        for bm, bn, bk, warps, st in itertools.product(blocks_m, (64, 128), ks, (4, 8), stages)
    ]


TILE_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def build(shape: Shape, tokens: int, seed: int = 0):
    """Experts with random weights (MXFP4: random codes, scales near 2**-7) and a routing."""
    torch.manual_seed(seed)
    experts = MoEExperts(
        shape.experts,
        shape.hidden,
        shape.inter,
        shape.activation,
        bias=shape.activation == "clamped_swiglu",
        weight_format=shape.fmt,
        mxfp4_layout=shape.layout if shape.fmt == "mxfp4" else None,
    )
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("_scale"):
                p.copy_(torch.randint(116, 124, p.shape))
            elif p.dtype == torch.uint8:
                p.copy_(torch.randint(0, 256, p.shape))
            else:
                p.normal_(0, 0.02)
    experts = experts.to(torch.bfloat16).cuda()
    x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(tokens, shape.experts, device="cuda")
    vals, ids = logits.topk(shape.top_k, dim=-1)
    per_expert = sum(p[0].nbytes for p in experts.parameters())
    nbytes = int(torch.unique(ids).numel()) * per_expert
    return experts, x, vals.softmax(-1).to(torch.bfloat16), ids.to(torch.int32), nbytes


def runner(shape: Shape, built, cfg: tm.MoEConfig):
    experts, x, wts, ids, _ = built
    extras = experts._kernel_extras() if shape.activation == "clamped_swiglu" else None
    if cfg.loaded_block_m is None:
        return lambda: tm.fused_moe_with_config(
            x, experts.w13, experts.w2, wts, ids, cfg, shape.activation,
            extras=extras, mxfp4_native=shape.native,
        )  # fmt: skip
    # Logits whose top-k are these ids and whose softmax over them gives these weights.
    logits = torch.full((ids.shape[0], shape.experts), -1e4, device=ids.device)
    logits.scatter_(1, ids.long(), wts.float().log())

    def grouped_by_the_router() -> torch.Tensor:
        fused = route_and_align(
            logits, shape.top_k, "topk_softmax", cfg.block_m, weights_dtype=x.dtype,
            loaded_block_m=cfg.loaded_block_m,
        )  # fmt: skip
        return tm.fused_moe_with_config(
            x, experts.w13, experts.w2, fused.weights, fused.ids, cfg, shape.activation,
            extras=extras, aligned=fused.aligned, weights_f32=fused.weights_f32,
        )  # fmt: skip

    return grouped_by_the_router


def compile_share(args: tuple[list[str], int, int, int]) -> int:
    """A worker: launch every ``index % workers == share`` variant once (fills the cache)."""
    names, tokens, share, workers = args
    done = 0
    index = 0
    for name in names:
        shape = SHAPES[name]
        built = build(shape, tokens)
        for cfg in grid(shape, tokens):
            if index % workers == share:
                try:
                    runner(shape, built, cfg)()
                    done += 1
                except Exception:  # a config that does not fit: timed as failed later
                    pass
            index += 1
    torch.cuda.synchronize()
    return done


def time_graph(fn) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(graph_replay.graphed(fn), warmup=10, rep=60, return_mode="median")


def parse_tile(default: tm.MoEConfig, text: str) -> tm.MoEConfig:
    """``BM,BN,BK,GROUP,WARPS,STAGES[,LOADED_BM[,MAXNREG]]`` over ``default`` (``LOADED_BM``
    0: one kind; ``MAXNREG`` a register cap, 0: none)."""
    values = [int(v) for v in text.split(",")]
    tile = default._replace(**dict(zip(TILE_FIELDS, values[:6], strict=True)))
    if len(values) >= 7:
        tile = tile._replace(loaded_block_m=values[6] or None)
    if len(values) == 8:
        tile = tile._replace(maxnreg=values[7] or None)
    return tile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--hbm-gbs", type=float, default=4800.0)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--tiles",
        nargs="+",
        default=None,
        help="only these tiles: BM,BN,BK,GROUP,WARPS,STAGES[,LOADED_BM (0: none)[,MAXNREG]]",
    )
    args = parser.parse_args()
    names = args.shapes.split(",")
    if args.workers > 1 and not args.tiles:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            pool.map(
                compile_share,
                [(names, args.tokens, i, args.workers) for i in range(args.workers)],
            )
    results = {}
    for name in names:
        shape = SHAPES[name]
        built = build(shape, args.tokens)
        nbytes = built[4]
        default = tm.moe_config(
            args.tokens,
            shape.top_k,
            shape.experts,
            mxfp4=shape.fmt == "mxfp4",
            layout=shape.layout,
        )
        rows = []
        want = None
        tiles = grid(shape, args.tokens)
        if args.tiles:
            tiles = [parse_tile(default, t) for t in args.tiles]
        for cfg in dict.fromkeys([default, *tiles]):
            try:
                fn = runner(shape, built, cfg)
                got = fn().float()
                want = got if want is None else want
                err = ((got - want).norm() / want.norm()).item()
                if not err < 1e-2:  # a tile that computes something else must not win
                    print(
                        f"{name} {tuple(cfg)} differs from the default: {err:.2e}", file=sys.stderr
                    )
                    continue
                ms = time_graph(fn)
            except Exception as exc:
                print(f"{name} {tuple(cfg)} failed: {type(exc).__name__}", file=sys.stderr)
                continue
            rows.append((ms, cfg))
        rows.sort(key=lambda r: r[0])
        bound_ms = nbytes / (args.hbm_gbs * 1e9) * 1e3
        print(
            f"\n{name} T={args.tokens}: {nbytes / 1e6:.0f} MB of weights, bound {bound_ms * 1e3:.0f} us"
        )
        default_ms = next((ms for ms, cfg in rows if cfg == default), float("nan"))
        print(
            f"  default {tuple(default)}: {default_ms * 1e3:.0f} us ({default_ms / bound_ms:.2f}x)"
        )
        for ms, cfg in rows[: args.top]:
            print(
                f"  {tuple(cfg)}: {ms * 1e3:.0f} us ({ms / bound_ms:.2f}x, {nbytes / ms / 1e6:.0f} GB/s)"
            )
        results[name] = {
            "bound_us": bound_ms * 1e3,
            "default": [list(default), default_ms * 1e3],
            "rows": [[list(cfg), ms * 1e3] for ms, cfg in rows],
        }
        del built
        torch.cuda.empty_cache()
    if len(results) > 1:
        first, *others = results
        base = min(ms for _, ms in results[first]["rows"])
        print(f"\nbest against {first}'s best ({base:.0f} us):")
        for name in others:
            if results[name]["rows"]:
                best_cfg, best = min(results[name]["rows"], key=lambda r: r[1])
                print(f"  {name}: {best:.0f} us, {base / best:.2f}x faster, {tuple(best_cfg)}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
