"""How fast the H200's warpgroup MMAs run at the narrow N a decode step's experts give them.

    PYTHONPATH=. python3 benchmarks/mma_shapes.py

At batch 256 an MXFP4 expert of gpt-oss gets ~32 tokens, so its GEMM (weights
as the left operand, decoded in registers; tokens as the right, N) issues
``wgmma.m64nNk16`` with N = 32.  This times chains of such products with
nothing else in the loop: one warpgroup a program, two 64-row accumulators
taking turns (as the MXFP4 kernels' 128-row tiles do), the left operand in
registers ("RS") or shared memory ("SS"), every multiprocessor busy.  The
table is dense bf16 TFLOP/s by N and programs a multiprocessor, so the
tensor-core floor of a layer's products at a given N reads straight off it.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

BLOCK_K = gl.constexpr(64)
ROWS = gl.constexpr(128)  # two m64 accumulators a warpgroup


@gluon.jit
def _mma_chain(a_ptr, b_ptr, out_ptr, steps, N: gl.constexpr, A_IN_REGISTERS: gl.constexpr):
    """``steps`` K-steps of [128, 64] x [64, N] products into one fp32 accumulator, then its sum."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
    )
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, blocked))
    a = gl.load(a_ptr + rows[:, None] * BLOCK_K + cols[None, :])
    krows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, blocked))
    ncols = gl.arange(0, N, layout=gl.SliceLayout(0, blocked))
    b = gl.load(b_ptr + krows[:, None] * N + ncols[None, :])
    b_smem = gl.allocate_shared_memory(
        gl.bfloat16,
        [BLOCK_K, N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_K, N], gl.bfloat16),
        b,
    )
    if A_IN_REGISTERS:
        a_op = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
    else:
        a_op = gl.allocate_shared_memory(
            gl.bfloat16,
            [ROWS, BLOCK_K],
            gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], gl.bfloat16),
            a,
        )
    acc = gl.zeros([ROWS, N], gl.float32, layout=mma)
    for _ in range(steps):
        acc = warpgroup_mma(a_op, b_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    total = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.atomic_add(out_ptr, total)


def tflops(n: int, in_registers: bool, programs_per_sm: int, steps: int) -> float:
    """Dense TFLOP/s of every multiprocessor running ``programs_per_sm`` chains at width ``n``."""
    a = torch.randn(ROWS.value, BLOCK_K.value, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(BLOCK_K.value, n, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(1, device="cuda", dtype=torch.float32)
    grid = (torch.cuda.get_device_properties(0).multi_processor_count * programs_per_sm,)

    def call() -> None:
        _mma_chain[grid](a, b, out, steps, N=n, A_IN_REGISTERS=in_registers, num_warps=4)

    ms = triton.testing.do_bench(call, warmup=20, rep=100)
    return 2 * ROWS.value * BLOCK_K.value * n * steps * grid[0] / (ms * 1e-3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4096, help="K steps of 64 a program")
    parser.add_argument("--widths", default="8,16,32,64,128,256")
    parser.add_argument("--programs", default="1,2,3,4", help="programs a multiprocessor")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    programs = [int(p) for p in args.programs.split(",")]
    print("| operand A | N | " + " | ".join(f"{p} a SM" for p in programs) + " |")
    print("|---|---:|" + "---:|" * len(programs))
    for in_registers in (True, False):
        for n in widths:
            row = [f"{tflops(n, in_registers, p, args.steps):.0f}" for p in programs]
            print(
                f"| {'registers' if in_registers else 'shared'} | {n} | " + " | ".join(row) + " |"
            )


if __name__ == "__main__":
    main()
