"""The MoE routing path, router logits to the fused-MoE GEMMs' inputs: torch ops vs fused kernels.

Columns (each a CUDA-graph replay, median of ``triton.testing.do_bench``, µs a layer):

- ``torch``: what a decode step runs by default, the float32 softmax, ``topk``
  (+ renormalisation, scaling), the weights' cast and ``align_routing`` (its
  counting program and its atomic scatter, which writes the capture);
- ``fused``: ``route_and_align``, one launch of the routing kernel (capture
  written there, the pairs grouped by expert), its counters kept as a layer keeps them;
- ``gain``: ``torch`` minus ``fused``, times the model's MoE layers (a decode step's gain).

``--sweep`` also times the routing kernel alone at every (rows a program, warps)
launch shape, to choose ``launch_shape``.

    python benchmarks/routing.py [--sweep]   # on the GPU
    python benchmarks/routing.py --smoke     # CPU, TRITON_INTERPRET=1: runs once, times nothing
"""

from __future__ import annotations

import sys

import torch
from kernels import DEV, SMOKE, bench, graphed  # benchmarks/kernels.py

from moetrace.kernels import triton_moe as tm
from moetrace.kernels.triton_align import align_routing
from moetrace.kernels.triton_routing import grouping_work, launch_shape, route, route_and_align
from moetrace.layers.moe import softmax_topk

# name: (experts, top_k, renormalize, scaling, logits dtype, weights dtype, MoE layers)
MODELS = {
    "olmoe-1b-7b": (64, 8, False, None, torch.bfloat16, torch.bfloat16, 16),
    "qwen3-30b-a3b": (128, 8, True, None, torch.bfloat16, torch.bfloat16, 48),
    "deepseek-v2-lite": (64, 6, False, 1.0, torch.float32, torch.float32, 26),
}


def torch_path(logits, experts, top_k, renormalize, scaling, wdtype, block_m, cap, cap_w):
    weights, ids = softmax_topk(logits, top_k, renormalize=renormalize)
    if scaling is not None:
        weights = weights * scaling
    weights = weights.to(wdtype)
    return align_routing(ids, experts, block_m, cap, topk_weights=weights, capture_weights=cap_w)


_WORK: dict[int, torch.Tensor] = {}  # a layer's counters, one per expert count


def fused_path(logits, experts, top_k, renormalize, scaling, wdtype, block_m, cap, cap_w):
    work = _WORK.setdefault(experts, grouping_work(experts, logits.device))
    return route_and_align(
        logits,
        top_k,
        "softmax_topk",
        block_m,
        renormalize=renormalize,
        scaling=scaling,
        weights_dtype=wdtype,
        capture=cap,
        capture_weights=cap_w,
        work=work,
    )


def sweep(logits, top_k, renormalize, scaling, wdtype, cap, cap_w) -> str:
    """The routing kernel alone at each launch shape: 'rows x warps: us' pairs, best first."""
    times = []
    for rows in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4):
            fn = graphed(
                lambda rows=rows, warps=warps: route(
                    logits,
                    top_k,
                    "softmax_topk",
                    renormalize=renormalize,
                    scaling=scaling,
                    weights_dtype=wdtype,
                    capture=cap,
                    capture_weights=cap_w,
                    rows=rows,
                    num_warps=warps,
                )
            )
            times.append((bench(fn) * 1e3, rows, warps))
    times.sort()
    return "  ".join(f"{r}x{w}: {t:.1f}" for t, r, w in times)


def main() -> None:
    tokens_list = [7] if SMOKE else [256, 8192]
    print(f"{'model':18s} {'T':>6s} {'torch':>8s} {'fused':>8s} {'gain/step':>10s}")
    for name, (experts, top_k, renorm, scaling, ldtype, wdtype, layers) in MODELS.items():
        for tokens in tokens_list:
            gen = torch.Generator().manual_seed(tokens)
            logits = torch.randn(tokens, experts, generator=gen).to(DEV, ldtype)
            cap = torch.zeros(tokens, top_k, dtype=torch.uint8, device=DEV)
            cap_w = torch.zeros(tokens, top_k, dtype=torch.float16, device=DEV)
            block_m = tm.moe_config(tokens, top_k, experts).block_m
            args = (logits, experts, top_k, renorm, scaling, wdtype, block_m, cap, cap_w)
            base = bench(graphed(lambda args=args: torch_path(*args)))
            fused = bench(graphed(lambda args=args: fused_path(*args)))
            print(
                f"{name:18s} {tokens:6d} {base * 1e3:8.1f} {fused * 1e3:8.1f}"
                f" {(base - fused) * 1e3 * layers:8.0f}us",
                flush=True,
            )
            if "--sweep" in sys.argv and tokens <= 1024:
                print(
                    f"  route kernel, rows x warps (default {launch_shape(experts)}): "
                    + sweep(logits, top_k, renorm, scaling, wdtype, cap, cap_w),
                    flush=True,
                )


if __name__ == "__main__":
    main()
