"""Router logits with ties and near-ties, and the checks the fused routing kernels must pass.

Shared by the CPU (``TRITON_INTERPRET=1``) and the CUDA tests of
``kernels/triton_routing.py``.  The references are torch's own ops: the
families' selection functions in ``layers/moe.py`` (the current path), and
``cuda_topk_order``, a model of the order ``torch.topk`` gives equal values
on CUDA (its CPU order differs), itself checked against CUDA's ``topk``.
"""

from __future__ import annotations

import numpy as np
import torch

from moetrace.layers.moe import softmax_topk, softmax_weights, topk_softmax, topk_softmax_weights

# (scoring, renormalize, scaling, weights dtype): the families' variants.
VARIANTS = {
    "olmoe/qwen": ("softmax_topk", False, None, torch.bfloat16),
    "mixtral/qwen3-norm": ("softmax_topk", True, None, torch.bfloat16),
    "deepseek-v2": ("softmax_topk", False, 2.5, torch.float32),
    "granite": ("topk_softmax", False, None, torch.bfloat16),
}


def tricky_logits(num_tokens: int, num_experts: int, seed: int, *, bf16: bool) -> torch.Tensor:
    """Float32 ``[T, E]`` logits: bf16-valued (ties abound) or float32, with planted ties
    (a row's best value copied onto other experts), near-ties (the next float up),
    one all-equal row and one row with a wide range (tiny probabilities)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_experts, generator=gen) * 2
    if bf16:
        x = x.to(torch.bfloat16).float()
    for t in range(num_tokens):
        kind = t % 4
        a, b, c = torch.randperm(num_experts, generator=gen)[:3].tolist()
        if kind == 0:  # a tie at the top
            x[t, a] = x[t, b] = x[t].max()
        elif kind == 1:  # a tie somewhere in the middle
            x[t, a] = x[t, c]
        elif kind == 2:  # a near-tie: the next float above
            x[t, a] = torch.nextafter(x[t, b], torch.tensor(float("inf")))
    if num_tokens > 4:
        x[4] = 0.5
    if num_tokens > 5:
        x[5] = torch.linspace(-60, 30, num_experts)[torch.randperm(num_experts, generator=gen)]
    return x


def reference(variant: str, logits: torch.Tensor, top_k: int):
    """(scores the current path ranks by, its weights, its ids), float32."""
    scoring, renormalize, _, _ = VARIANTS[variant]
    if scoring == "softmax_topk":
        scores = torch.softmax(logits, dim=-1)
        weights, ids = softmax_topk(logits, top_k, renormalize=renormalize)
    else:
        scores = logits
        weights, ids = topk_softmax(logits, top_k)
    return scores, weights, ids


def reference_weights(variant: str, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The current path's float32 weights for ``ids`` (scaled where the family scales)."""
    scoring, renormalize, scaling, _ = VARIANTS[variant]
    if scoring == "softmax_topk":
        weights = softmax_weights(logits, ids, renormalize=renormalize)
    else:
        weights = topk_softmax_weights(logits, ids)
    return weights if scaling is None else weights * scaling


def unambiguous_rows(scores: torch.Tensor, logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool [T]: rows whose ``top_k + 1`` best scores are all distinct, so that any
    correct top-k (whatever its tie rule) picks the same ids in the same order."""
    n = min(top_k + 1, scores.shape[1])
    best = torch.sort(scores, dim=-1, descending=True).values[:, :n]
    return (best[:, 1:] != best[:, :-1]).all(dim=1)


def numpy_warp_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Float32 softmax with numpy's ``exp``, summed in the order of torch's CUDA warp
    softmax (lane ``l`` adds ``l, l + W, ...``, then the lanes halve by XOR): what the
    routing kernel computes in the interpreter, bit for bit."""
    x = logits.float().cpu().numpy()
    rows, experts = x.shape
    width = 1 << max(experts - 1, 0).bit_length()  # the next power of two
    e = np.zeros((rows, width), np.float32)
    e[:, :experts] = np.exp(x - x.max(axis=1, keepdims=True)).astype(np.float32)
    warp = min(width, 32)
    lanes = np.zeros((rows, warp), np.float32)
    for it in range(width // warp):
        lanes = lanes + e[:, it * warp : (it + 1) * warp]
    while lanes.shape[1] > 1:
        half = lanes.shape[1] // 2
        lanes = lanes[:, :half] + lanes[:, half:]
    return torch.from_numpy(e[:, :experts] / lanes)


SORT_SLOTS = 32  # torch's small bitonic sort of a top-k's k values (k <= 32)


def cuda_topk_order(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids ``torch.topk(scores, top_k)`` returns on CUDA (k <= 32, no NaNs), modelled.

    Its selection writes the values above the k-th largest in index order, then
    as many equal to it as fit, in index order; its sort of those k values is a
    bitonic network over 32 slots (unstable: the slots that equal values start
    from decide their order).  The network, slot by slot: a compare-exchange of
    slots ``p`` and ``p + stride`` (``p``'s ``stride`` bit clear) swaps when
    ``(key[p] > key[p + stride] and p valid) or p + stride invalid`` equals the
    stage's direction, ``p & size`` for the merges of ``size < 32`` and false
    for the last.  ``tests/kernels/test_gpu_routing.py`` checks this model against
    CUDA's ``torch.topk``; ``kernels/triton_routing.py`` computes it.
    """
    scores = scores.float().cpu()
    rows = scores.shape[0]
    kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # the k-th largest value
    index = torch.arange(scores.shape[1]).expand(rows, -1)
    above = torch.where(scores > kth, index, scores.shape[1]).sort(dim=-1).values
    equal = torch.where(scores == kth, index, scores.shape[1]).sort(dim=-1).values
    keys = torch.zeros(rows, SORT_SLOTS)
    ids = torch.full((rows, SORT_SLOTS), -1, dtype=torch.long)  # -1: an invalid slot
    for r in range(rows):
        picked = [i for i in above[r].tolist() if i < scores.shape[1]]
        picked += [i for i in equal[r].tolist() if i < scores.shape[1]][: top_k - len(picked)]
        ids[r, :top_k] = torch.tensor(picked)
        keys[r, :top_k] = scores[r, picked]
    slot = torch.arange(SORT_SLOTS)
    stages = [(size, stride) for size in (2, 4, 8, 16) for stride in _halvings(size // 2)]
    stages += [(0, stride) for stride in _halvings(SORT_SLOTS // 2)]  # size 0: direction false
    for size, stride in stages:
        a = slot[(slot & stride) == 0]
        b = a + stride
        direction = (a & size) != 0
        ka, kb, va, vb = keys[:, a], keys[:, b], ids[:, a], ids[:, b]
        swap = ((ka > kb) & (va >= 0)) | (vb < 0)
        exchange = swap == direction
        keys[:, a], keys[:, b] = torch.where(exchange, kb, ka), torch.where(exchange, ka, kb)
        ids[:, a], ids[:, b] = torch.where(exchange, vb, va), torch.where(exchange, va, vb)
    return ids[:, :top_k]


def _halvings(start: int) -> list[int]:
    return [start >> i for i in range(start.bit_length())]


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in float32 units in the last place (both non-negative)."""
    return int((a.float().view(torch.int32) - b.float().view(torch.int32)).abs().max())


def check_route(variant: str, logits: torch.Tensor, top_k: int, route, max_ulps: int) -> dict:
    """Run ``route`` (the kernel entry point) and check it against the current path.

    Returns counts for the caller's non-vacuity checks.
    """
    scoring, renormalize, scaling, wdtype = VARIANTS[variant]
    ref_logits = logits  # torch's ops on the same device: on CUDA, its CUDA kernels
    weights, ids, weights_f32 = route(
        logits, top_k, scoring, renormalize=renormalize, scaling=scaling, weights_dtype=wdtype
    )
    ids = ids.long()
    scores, _, ref_ids = reference(variant, ref_logits, top_k)
    # Every row: the documented rule on what the path ranks (the lower indices among equal
    # values at the k-th place, in the order CUDA's torch.topk leaves equal values).  On
    # CUDA those are torch's probabilities and its ids; the interpreter's exp is numpy's.
    ranked = scores
    if not logits.is_cuda and scoring == "softmax_topk":
        ranked = numpy_warp_softmax(ref_logits)
    assert torch.equal(ids.cpu(), cuda_topk_order(ranked, top_k))
    if logits.is_cuda:
        assert torch.equal(ids, ref_ids)
    # Rows where the current path is unambiguous (and so is the interpreter's ranking):
    # exactly its ids, in its order.
    clear = unambiguous_rows(scores, ref_logits, top_k)
    clear &= unambiguous_rows(ranked, ref_logits, top_k).to(clear.device)
    assert torch.equal(ids[clear], ref_ids[clear])
    # Weights: the family's rule for these ids, to max_ulps in float32, then the same cast.
    want = reference_weights(variant, ref_logits, ids)
    got32 = route(
        logits,
        top_k,
        scoring,
        renormalize=renormalize,
        scaling=scaling,
        weights_dtype=torch.float32,
    )[0]
    assert ulps(got32, want) <= max_ulps, ulps(got32, want)
    assert torch.equal(weights, got32.to(wdtype))
    assert torch.equal(weights_f32, weights.float())
    return {"rows": len(ids), "clear": int(clear.sum()), "ulps": ulps(got32, want)}
