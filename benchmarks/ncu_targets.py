"""Launch one decode-size kernel three times, for Nsight Compute to profile.

    ncu --clock-control none --set full --import-source yes --launch-skip 2 --launch-count 2 \\
        --kernel-name regex:fragment_kernel -o frag python3 benchmarks/ncu_targets.py moe gpt-oss-mx-frag
    ncu --import frag.ncu-rep --page details

``moe SHAPE``: one layer's experts at T=256 on ``benchmarks/moe_tiles.py``'s
shapes, the default tile (kernels ``_gate_up_kernel``/``_down_kernel``, or
``*_fragment_kernel`` for MXFP4); ``attn NAME``: decode attention at batch
256, context 384 (``_paged_attention_kernel``).  The first launch compiles,
so skip it (``--launch-skip``) and profile the next.
"""

from __future__ import annotations

import argparse
from functools import partial

import kernels
import moe_tiles
import torch

from moetrace.kernels import triton_attention as ta
from moetrace.kernels import triton_moe as tm

ATTENTION = {  # q heads, kv heads, head dim, sliding window, sinks
    "olmoe": (16, 16, 128, None, False),
    "qwen3": (32, 4, 128, None, False),
    "gpt-oss-full": (64, 8, 64, None, True),
    "gpt-oss-window": (64, 8, 64, 128, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("moe", "attn"))
    parser.add_argument(
        "name", help=f"moe: {', '.join(moe_tiles.SHAPES)}; attn: {', '.join(ATTENTION)}"
    )
    args = parser.parse_args()
    if args.kind == "moe":
        shape = moe_tiles.SHAPES[args.name]
        built = moe_tiles.build(shape, 256)
        cfg = tm.moe_config(
            256, shape.top_k, shape.experts, mxfp4=shape.fmt == "mxfp4", layout=shape.layout
        )
        print(f"{args.name}: {cfg}, {built[4] / 1e6:.0f} MB of weights")
        fn = moe_tiles.runner(shape, built, cfg)
    else:
        heads, kv_heads, dim, window, sinks = ATTENTION[args.name]
        q, kc, vc, meta = kernels.paged_batch([1] * 256, [384] * 256, heads, kv_heads, dim)
        sk = torch.randn(heads, dtype=torch.bfloat16, device="cuda") if sinks else None
        fn = partial(
            ta.paged_attention, q, kc, vc, meta, dim**-0.5, sliding_window=window, sinks=sk
        )
    for _ in range(3):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
