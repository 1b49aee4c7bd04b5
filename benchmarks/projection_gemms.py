"""A decode step's dense projections at M=256 tokens: cuBLAS ``F.linear`` against a plain
Triton GEMM swept over tiles, each replayed from a CUDA graph (``do_bench`` medians,
the replay's launch included).  Decides whether those GEMMs should leave cuBLAS.

    python benchmarks/projection_gemms.py      # on the GPU
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graph_replay import graphed
from triton.testing import do_bench

# name: (K, N) of the weight [N, K]
SHAPES = {
    "qwen3 qkv": (2048, 5120),
    "qwen3 o": (4096, 2048),
    "qwen3 router": (2048, 128),
    "olmoe qkv": (2048, 6144),
    "olmoe o": (2048, 2048),
    "olmoe router": (2048, 64),
}
TOKENS = 256
HBM_BYTES_S = 4.29e12  # the H200's measured copy rate


@triton.jit
def _linear_kernel(a, w, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``c = a @ w.T`` in float32, rounded to bf16; the M tiles of one N tile run together."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m, pid_n = pid % num_m, pid // num_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M)
        y = tl.load(w + rn[None, :] * K + (k + rk)[:, None], mask=rn[None, :] < N)
        acc = tl.dot(x, y, acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)


def main() -> None:
    for name, (k, n) in SHAPES.items():
        x = torch.randn(TOKENS, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        ref = F.linear(x, w)
        cublas = do_bench(graphed(lambda x=x, w=w: F.linear(x, w)), rep=200, return_mode="median")
        bound = (k * n + TOKENS * k + TOKENS * n) * 2 / HBM_BYTES_S * 1e6
        out = torch.empty(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        results = []
        tiles = itertools.product((64, 128, 256), (32, 64, 128), (64, 128), (3, 4, 5))
        for bm, bn, bk, stages in tiles:
            if bn > n or (bm + bn) * bk * 2 * stages > 200_000:
                continue
            grid = (triton.cdiv(TOKENS, bm) * triton.cdiv(n, bn),)

            def run(grid=grid, bm=bm, bn=bn, bk=bk, stages=stages, x=x, w=w, n=n, k=k, out=out):
                _linear_kernel[grid](
                    x, w, out, TOKENS, n, k, BM=bm, BN=bn, BK=bk, num_stages=stages, num_warps=4
                )

            run()
            same = torch.equal(out, ref)
            t = do_bench(graphed(run), rep=100, return_mode="median")
            results.append((t * 1e3, f"{bm}x{bn}x{bk} s{stages}", same))
        results.sort()
        best = "; ".join(f"{t:.1f} ({tile}, same as cuBLAS: {s})" for t, tile, s in results[:3])
        print(
            f"{name:14s} K={k} N={n} bound {bound:.1f} us, cuBLAS {cublas * 1e3:.1f} us,"
            f" best Triton tiles: {best}",
            flush=True,
        )


if __name__ == "__main__":
    main()
