"""The MoE routing path, router logits to the fused-MoE GEMMs' inputs: torch ops vs fused kernels.

Old: the logits' cast, softmax, ``topk`` (+ renormalisation, scaling), the
weights' cast, the two alignment kernels (capture written by the scatter)
and the weights' cast to float32, as a decode step ran them before
``kernels/triton_routing.py``.  New: ``route_and_align``, with the capture
written by the routing kernel (and, last column but one, the routing kernel
followed by the two-kernel ``align_routing`` instead of the one-program
alignment).  Both replayed from a CUDA graph (as in
decode), median of ``triton.testing.do_bench``; the last column is the
difference times the model's MoE layers (what a decode step gains).

    python benchmarks/routing.py            # on the GPU
    python benchmarks/routing.py --smoke    # CPU, TRITON_INTERPRET=1: runs once, times nothing
"""

from __future__ import annotations

import torch
from kernels import DEV, SMOKE, bench, graphed  # benchmarks/kernels.py

from moetrace.kernels import triton_moe as tm
from moetrace.kernels.triton_routing import route, route_and_align
from moetrace.layers.moe import softmax_topk

# name: (experts, top_k, renormalize, scaling, logits dtype, weights dtype, MoE layers)
MODELS = {
    "olmoe-1b-7b": (64, 8, False, None, torch.bfloat16, torch.bfloat16, 16),
    "qwen3-30b-a3b": (128, 8, True, None, torch.bfloat16, torch.bfloat16, 48),
    "deepseek-v2-lite": (64, 6, False, 1.0, torch.float32, torch.float32, 26),
}


def old_path(logits, experts, top_k, renormalize, scaling, wdtype, block_m, cap, cap_w):
    weights, ids = softmax_topk(logits.float(), top_k, renormalize=renormalize)
    if scaling is not None:
        weights = weights * scaling
    weights = weights.to(wdtype)
    aligned = tm.align_routing(
        ids, experts, block_m, cap, topk_weights=weights, capture_weights=cap_w
    )
    return aligned, weights.reshape(-1).to(torch.float32)


def new_path(logits, experts, top_k, renormalize, scaling, wdtype, block_m, cap, cap_w):
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
    )


def new_two_align(logits, experts, top_k, renormalize, scaling, wdtype, block_m, cap, cap_w):
    """The routing kernel, then the two-kernel alignment (``align_routing``)."""
    weights, ids, weights_f32 = route(
        logits,
        top_k,
        "softmax_topk",
        renormalize=renormalize,
        scaling=scaling,
        weights_dtype=wdtype,
        capture=cap,
        capture_weights=cap_w,
    )
    return tm.align_routing(ids, experts, block_m), weights_f32


def main() -> None:
    tokens_list = [7] if SMOKE else [256, 8192]
    print(
        f"{'model':18s} {'T':>6s} {'old us':>9s} {'new us':>9s} {'new, 2-kernel align':>20s}"
        f" {'step gain us':>13s}"
    )
    for name, (experts, top_k, renorm, scaling, ldtype, wdtype, layers) in MODELS.items():
        for tokens in tokens_list:
            gen = torch.Generator().manual_seed(tokens)
            logits = torch.randn(tokens, experts, generator=gen).to(DEV, ldtype)
            cap = torch.zeros(tokens, top_k, dtype=torch.uint8, device=DEV)
            cap_w = torch.zeros(tokens, top_k, dtype=torch.float16, device=DEV)
            block_m = tm.moe_config(tokens, top_k, experts).block_m
            args = (logits, experts, top_k, renorm, scaling, wdtype, block_m, cap, cap_w)
            old = bench(graphed(lambda args=args: old_path(*args)))
            new = bench(graphed(lambda args=args: new_path(*args)))
            two = bench(graphed(lambda args=args: new_two_align(*args)))
            gain = (old - min(new, two)) * 1e3 * layers
            print(
                f"{name:18s} {tokens:6d} {old * 1e3:9.1f} {new * 1e3:9.1f} {two * 1e3:20.1f}"
                f" {gain:13.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
