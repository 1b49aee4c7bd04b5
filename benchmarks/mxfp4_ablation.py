"""What a cheaper MXFP4 decoder would buy: the fragment GEMMs timed with stand-in decoders.

    PYTHONPATH=. python3 benchmarks/mxfp4_ablation.py [--variants real,multiplies,...]

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
  the search in the docs found to exist.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from moetrace.kernels.mxfp4_layout import FAST_DECODE_PTX

VARIANTS = {
    "real": None,
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


def time_variant(name: str) -> float:
    """In this process: install the variant's decoder, time the layer's experts (us)."""
    import moe_tiles
    import triton.language as tl

    from moetrace.kernels import triton_moe as tm
    from moetrace.kernels import triton_mxfp4

    if VARIANTS[name] is not None:
        triton_mxfp4._FAST_DECODE_PTX = tl.constexpr(VARIANTS[name])
    shape = moe_tiles.SHAPES["gpt-oss-mx-frag"]
    fn = moe_tiles.runner(shape, moe_tiles.build(shape, 256), tm.FRAGMENT_DECODE)
    return min(moe_tiles.time_graph(fn) for _ in range(3)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(f"{time_variant(args.one):.1f}")
        return
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            run = subprocess.run(
                [sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True
            )
        if run.returncode:
            print(f"{name}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
            continue
        print(f"{name:14s} {float(run.stdout.split()[-1]):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
