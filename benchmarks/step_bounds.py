"""A step's bound: its FLOPs at the device's matmul rate or its bytes at its copy rate,
whichever takes longer, counted from the model's shapes and what the step ran.

FLOPs: 2 per weight element a token meets (the dense weights, and in each MoE layer its
top-k experts), 2 x hidden x vocab per row the step samples (the LM head runs on those
rows only), and attention: 2 x heads x (key width + value width) per query and key of
its context (a sliding window's keys only).  Bytes: every dense weight once, the
embedding rows of the step's tokens, the LM head when the step samples, each expert the
step's tokens reached once (per MoE layer, from the captured routing), each sequence's
KV once at its context, and the KV the step writes.  Activations, the norms' arithmetic
and a graph's padding rows count nothing: this is a floor, not a model of the kernels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceRates:
    flops_per_s: float  # a large dense matmul in the model's dtype
    bytes_per_s: float  # a device-to-device copy, bytes read plus written


@dataclass(frozen=True)
class ModelCosts:
    """What a step pays per token, per sampled row and per reached expert."""

    dense_bytes: int  # every weight but the experts, the embedding and the LM head
    dense_flops_per_token: int
    embedding_row_bytes: int
    head_bytes: int
    head_flops_per_row: int
    expert_bytes: np.ndarray  # int64 [moe layers]: one routed expert's tensors
    expert_flops_per_token: int  # the top-k experts of every MoE layer
    kv_bytes_per_token: np.ndarray  # int64 [attention layers]
    attention_flops_per_key: np.ndarray  # int64 [attention layers]: one query against one key
    windows: np.ndarray  # int64 [attention layers]: sliding window in tokens, 0 for none


@dataclass(frozen=True)
class StepShape:
    """What one step ran: per sequence its new tokens and its context after them."""

    new_tokens: np.ndarray  # int64 [B]
    seq_lens: np.ndarray  # int64 [B]
    sampled_rows: int
    experts_reached: np.ndarray  # int64 [moe layers]: distinct experts the tokens went to

    @property
    def num_tokens(self) -> int:
        return int(self.new_tokens.sum())


def model_costs(model) -> ModelCosts:
    """``ModelCosts`` of a moetrace model, from its parameters and attention layers."""
    blocks = model.moe_blocks()
    expert_params = {id(p) for block in blocks for p in block.experts.parameters()}
    embedding = model.embed_tokens.weight
    head = list(model.lm_head.parameters())
    apart = expert_params | {id(embedding)} | {id(p) for p in head}
    dense = [p for p in model.parameters() if id(p) not in apart]
    item = embedding.element_size()
    layers = list(model.attention_layers())
    return ModelCosts(
        dense_bytes=sum(p.nbytes for p in dense),
        dense_flops_per_token=2 * sum(p.numel() for p in dense if p.dim() >= 2),
        embedding_row_bytes=embedding.shape[1] * item,
        head_bytes=sum(p.nbytes for p in head),
        head_flops_per_row=2 * model.lm_head.weight.numel(),
        expert_bytes=np.array(
            [sum(p[0].nbytes for p in block.experts.parameters()) for block in blocks],
            dtype=np.int64,
        ),
        expert_flops_per_token=sum(2 * block.top_k * _expert_elements(block) for block in blocks),
        kv_bytes_per_token=np.array(
            [sum(math.prod(s) for s in layer.kv_cache_shapes(1, 1)) * item for layer in layers],
            dtype=np.int64,
        ),
        attention_flops_per_key=np.array([_flops_per_key(layer) for layer in layers], np.int64),
        windows=np.array([layer.sliding_window or 0 for layer in layers], dtype=np.int64),
    )


def _expert_elements(block) -> int:
    """Weight elements of one expert: gate and up (``w13``) and down (``w2``), whatever
    their storage (MXFP4 packs two a byte)."""
    experts = block.experts
    hidden = experts.w2.shape[1]
    return 3 * hidden * experts.intermediate


def _flops_per_key(layer) -> int:
    """FLOPs of one query against one key: its scores and its weighted values, every head.
    MLA counts its heads' own key and value widths (the expanded form, the smaller count)."""
    dims = getattr(layer, "dims", None)
    if dims is not None:
        return 2 * dims.num_heads * (dims.qk_dim + dims.v_dim)
    return 4 * layer.num_heads * layer.head_dim


def keys_attended(start: np.ndarray, end: np.ndarray, window: int) -> np.ndarray:
    """Per sequence, the keys its queries at positions ``start .. end - 1`` attend in all:
    ``p + 1`` for position ``p``, at most ``window`` (0: no window)."""

    def up_to(n: np.ndarray) -> np.ndarray:  # sum of min(q, window) for q = 1 .. n
        if not window:
            return n * (n + 1) // 2
        m = np.minimum(n, window)
        return m * (m + 1) // 2 + (n - m) * window

    return up_to(end) - up_to(start)


def keys_read(start: np.ndarray, end: np.ndarray, window: int) -> np.ndarray:
    """Per sequence, the distinct keys its queries read: its whole context, or with a
    window from ``window - 1`` before its first query on."""
    if not window:
        return end
    return end - np.maximum(0, start - window + 1)


def step_flops(costs: ModelCosts, step: StepShape) -> int:
    end = step.seq_lens
    start = end - step.new_tokens
    flops = step.num_tokens * (costs.dense_flops_per_token + costs.expert_flops_per_token)
    flops += step.sampled_rows * costs.head_flops_per_row
    for per_key, window in zip(costs.attention_flops_per_key, costs.windows, strict=True):
        flops += int(per_key) * int(keys_attended(start, end, int(window)).sum())
    return int(flops)


def step_bytes(costs: ModelCosts, step: StepShape) -> int:
    end = step.seq_lens
    start = end - step.new_tokens
    total = costs.dense_bytes + step.num_tokens * costs.embedding_row_bytes
    total += costs.head_bytes if step.sampled_rows else 0
    total += int((step.experts_reached * costs.expert_bytes).sum())
    for per_token, window in zip(costs.kv_bytes_per_token, costs.windows, strict=True):
        read = int(keys_read(start, end, int(window)).sum())
        total += int(per_token) * (read + step.num_tokens)
    return int(total)


def step_bound(costs: ModelCosts, step: StepShape, rates: DeviceRates) -> tuple[float, float]:
    """(seconds its FLOPs take, seconds its bytes take); the bound is the larger."""
    return (
        step_flops(costs, step) / rates.flops_per_s,
        step_bytes(costs, step) / rates.bytes_per_s,
    )


def measure_rates(
    device: torch.device, dtype: torch.dtype, *, copy_bytes: int = 4 << 30, matmul_size: int = 8192
) -> DeviceRates:
    """The device's dense matmul rate (``matmul_size`` cubed, in ``dtype``) and its copy
    rate (``copy_bytes`` read and written a call), each the best of a few timed rounds."""
    rates = DeviceRates(_matmul_rate(device, dtype, matmul_size), _copy_rate(device, copy_bytes))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


def _copy_rate(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return nbytes / _best_seconds(lambda: dst.copy_(src), device)


def _matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), device)


def _best_seconds(call: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Seconds one ``call`` takes: the best of three rounds of ``repeats`` calls, after three
    unmeasured ones (CUDA events on the GPU, the wall clock elsewhere)."""
    for _ in range(3):
        call()
    best = math.inf
    for _ in range(3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                call()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            for _ in range(repeats):
                call()
            seconds = time.perf_counter() - begin
        best = min(best, seconds / repeats)
    return best
