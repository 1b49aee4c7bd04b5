"""What a cheaper MXFP4 decoder, or another layout, would buy: stand-ins in the fragment GEMMs.

    PYTHONPATH=. python3 benchmarks/mxfp4_ablation.py [--variants real,multiplies,...] [--balanced]
    PYTHONPATH=. python3 benchmarks/mxfp4_ablation.py --block-kinds

Each variant replaces the fast decoder's PTX block (``kernels/mxfp4_layout.py``)
with one that issues fewer or other instructions and computes *wrong values*
on purpose, then times one layer of gpt-oss-20b's MXFP4 experts at batch 256
(``benchmarks/moe_tiles.py``'s shape, the default tile, a CUDA-graph replay)
in a fresh process with a Triton cache of its own, so no variant reuses
another's binary.  The gap between ``real`` and ``multiplies`` bounds what
any decoder rewrite can save:

* ``real``: the decoder the kernels run (11 integer operations and 4 bf16
  multiplies a word);
* ``multiplies``: the 4 multiplies alone, chained (a decoder that costs nothing
  beyond scaling);
* ``no-multiplies``: the integer operations alone (values left unscaled);
* ``rotates``: 13 operations a word (three rotates, a bit-select), a layout
  the search in the docs found to exist;
* ``tile-major``: the real decoder, the words of whole chunks read as if
  each 128-row tile kept all its chunks together (``[N/128, C, 128, 64]``
  bytes) rather than chunk-major (``[C, N, 64]``): a program's whole read one
  contiguous stream.

``--balanced`` routes every expert exactly ``T k / E`` tokens (32 at batch
256), so no expert needs a second token block: what the routing's imbalance
costs the GEMMs.

``--block-kinds`` (the real decoder) splits a random routing's pairs by their
expert's load: experts of up to 32 tokens (one block) and of more (two blocks
of 32, or one of 64 that decodes each weight once), each kind timed as its own
call of the fused MoE (top-1 over the kind's pairs), on 32- and 64-token tiles,
and both kinds side by side on two streams: what giving the loaded experts
blocks of their own would buy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import triton
import triton.language as tl

from moetrace.kernels.mxfp4_layout import FAST_DECODE_PTX
from moetrace.kernels.triton_mxfp4 import fragment_tile

VARIANTS = {
    "real": None,
    "tile-major": None,
    "multiplies": """{
mul.rn.bf16x2 $0, $4, $5;
mul.rn.bf16x2 $1, $0, $5;
mul.rn.bf16x2 $2, $1, $5;
mul.rn.bf16x2 $3, $2, $5;
}
""",
    # the real block without its multiplies: the values left unscaled
    "no-multiplies": "\n".join(
        line for line in FAST_DECODE_PTX.splitlines() if not line.startswith("mul.")
    ),
    "rotates": """{
.reg .b32 t0, t1;
and.b32 $0, $4, 0x81C081C0;
mul.rn.bf16x2 $0, $0, $5;
shf.l.wrap.b32 t0, $4, $4, 4;
and.b32 $1, t0, 0x81C081C0;
mul.rn.bf16x2 $1, $1, $5;
shf.l.wrap.b32 t0, $4, $4, 10;
and.b32 $2, t0, 0x81C081C0;
mul.rn.bf16x2 $2, $2, $5;
shf.l.wrap.b32 t0, $4, $4, 6;
shf.l.wrap.b32 t1, $4, $4, 14;
and.b32 t1, t1, 0x80C080C0;
and.b32 t0, t0, 0x01000100;
or.b32 $3, t0, t1;
mul.rn.bf16x2 $3, $3, $5;
}
""",
}


@triton.jit
def tile_major_tile(
    w_ptr, s_ptr, rows, k0, k, stride_wc, stride_sc, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr
):
    """A stand-in for ``fragment_tile``: whole chunks' words at tile-major addresses."""
    if MASK_K:
        words, scales = fragment_tile(
            w_ptr, s_ptr, rows, k0, k, stride_wc, stride_sc, BLOCK_K, MASK_K
        )
    else:
        C: tl.constexpr = BLOCK_K // 128
        R: tl.constexpr = rows.shape[0]
        n = stride_wc // 64  # rows of the matrix
        whole = k // 128  # whole chunks a row
        first = (rows // 128) * 128
        in_tile = tl.minimum(n - first, 128)
        j = tl.arange(0, 16 * C)
        chunk = k0 // 128 + j // 16
        word = (first * whole)[:, None] + chunk[None, :] * in_tile[:, None]
        word = (word + (rows % 128)[:, None]) * 16 + (j % 16)[None, :]
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + word)
        i = tl.arange(0, 4 * C)
        scale_ptr = s_ptr + (k0 // 128 + i // 4)[None, :] * stride_sc + rows[:, None] * 4
        scales = tl.load(scale_ptr + (i % 4)[None, :])
        words = tl.permute(tl.reshape(words, (R, C, 4, 4)), (0, 1, 3, 2))
        words = tl.reshape(words, (R, 4 * C, 4))
        scales = tl.reshape(scales, (R, 4 * C, 1))
    return words, scales


def best_us(fn) -> float:
    """The best of three graph-replay timings of ``fn`` (``moe_tiles.time_graph``), in µs."""
    import moe_tiles

    return min(moe_tiles.time_graph(fn) for _ in range(3)) * 1e3


def time_variant(name: str, balanced: bool) -> float:
    """In this process: install the variant, time the layer's experts (us)."""
    import moe_tiles
    import torch

    from moetrace.kernels import triton_moe as tm
    from moetrace.kernels import triton_mxfp4

    if name == "tile-major":
        tm.fragment_tile = tile_major_tile
    elif VARIANTS[name] is not None:
        triton_mxfp4._FAST_DECODE_PTX = tl.constexpr(VARIANTS[name])
    shape = moe_tiles.SHAPES["gpt-oss-mx-frag"]
    built = moe_tiles.build(shape, 256)
    if balanced:  # token t takes experts 4t .. 4t + 3 (mod 32): 32 pairs each
        experts, x, weights, ids, nbytes = built
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        picks = torch.arange(shape.top_k, device=ids.device)[None, :]
        ids = ((token * shape.top_k + picks) % shape.experts).to(ids.dtype)
        built = (experts, x, weights, ids, nbytes)
    return best_us(moe_tiles.runner(shape, built, tm.FRAGMENT_DECODE))


def block_kinds() -> None:
    """The ``--block-kinds`` timings (see the module doc), printed as they come."""
    import moe_tiles
    import torch

    from moetrace.kernels import triton_moe as tm

    shape = moe_tiles.SHAPES["gpt-oss-mx-frag"]
    experts, x, weights, ids, _ = moe_tiles.build(shape, 256)
    extras = experts._kernel_extras()
    counts = torch.bincount(ids.flatten().long(), minlength=shape.experts)
    print(f"tokens an expert: {sorted(counts.tolist())}")
    pair_expert = ids.flatten().long()
    pair_token = torch.arange(ids.numel(), device=ids.device) // shape.top_k
    one_block = counts[pair_expert] <= 32
    tiles = {
        "32-token blocks": tm.FRAGMENT_DECODE,
        "64-token blocks, 4 warps": tm.MoEConfig(64, 128, 128, 8, 4, 3, mxfp4_native=False),
        "64-token blocks, 8 warps": tm.MoEConfig(64, 128, 128, 8, 8, 3, mxfp4_native=False),
        "64 tokens x 64 rows": tm.MoEConfig(64, 64, 128, 8, 4, 3, mxfp4_native=False),
    }

    def call(mask: torch.Tensor, cfg: tm.MoEConfig):
        rows = x[pair_token[mask]].contiguous()
        kind_ids = ids.flatten()[mask][:, None].contiguous()
        ones = torch.ones(kind_ids.shape, dtype=torch.bfloat16, device=ids.device)
        return lambda: tm.fused_moe_with_config(
            rows, experts.w13, experts.w2, ones, kind_ids, cfg, shape.activation, extras=extras
        )

    kinds = {"all pairs": torch.ones_like(one_block), "one-block experts": one_block}
    kinds["two-block experts"] = ~one_block
    for kind, mask in kinds.items():
        for label, cfg in tiles.items():
            if kind == "one-block experts" and cfg is not tm.FRAGMENT_DECODE:
                continue
            print(f"{kind:18s} {label:25s} {best_us(call(mask, cfg)):7.1f} us", flush=True)
    side = torch.cuda.Stream()
    for label, cfg in tiles.items():
        if cfg.block_n != 128:
            continue
        small, loaded = call(one_block, tm.FRAGMENT_DECODE), call(~one_block, cfg)

        def both(small=small, loaded=loaded) -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            small()
            with torch.cuda.stream(side):
                loaded()
            main.wait_stream(side)

        print(
            f"side by side: one-block experts 32-token, two-block {label}: {best_us(both):7.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--balanced", action="store_true")
    parser.add_argument("--block-kinds", action="store_true")
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block_kinds:
        block_kinds()
        return
    if args.one:
        print(f"{time_variant(args.one, args.balanced):.1f}")
        return
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            run = subprocess.run(
                [sys.executable, __file__, "--one", name] + ["--balanced"] * args.balanced,
                env=env,
                capture_output=True,
                text=True,
            )
        if run.returncode:
            print(f"{name}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
            continue
        print(f"{name:14s} {float(run.stdout.split()[-1]):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
