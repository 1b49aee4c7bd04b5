"""Expert load per MoE layer, streamed over a trace so that it never has to fit in memory.

``expert_counts`` makes one pass over the rows; everything else is a pure
function of the resulting ``(num_moe_layers, num_experts)`` counts array, so it
can be tested on hand-built counts and reused on counts from anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace

STATS_CHUNK_ROWS = 8192  # bincount widens one layer's ids to intp: a few MB at a time


def counts_from_rows(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """``(L, E)`` selection counts of ``rows`` ``(n, L, k)``.

    One bincount per layer on the narrow ids: measured 2-3x faster for uint8 ids
    than offsetting ids by ``layer * E`` into one intp array for a single bincount.
    """
    counts = np.empty((rows.shape[1], num_experts), dtype=np.int64)
    for layer in range(rows.shape[1]):
        c = np.bincount(rows[:, layer].ravel(), minlength=num_experts)
        if len(c) > num_experts:
            raise MoetraceError(f"expert id {len(c) - 1} >= num_experts {num_experts}")
        counts[layer] = c
    return counts


def expert_counts(trace: Trace, chunk_rows: int = STATS_CHUNK_ROWS) -> np.ndarray:
    """How often each expert of each MoE layer was selected, over every row of the trace."""
    counts = np.zeros((trace.num_moe_layers, trace.num_experts), dtype=np.int64)
    for _, rows in trace.iter_row_chunks(chunk_rows):
        counts += counts_from_rows(rows, trace.num_experts)
    return counts


def _mean(counts: np.ndarray) -> np.ndarray:
    return counts.sum(axis=1) / counts.shape[1]


def max_violation(counts: np.ndarray) -> np.ndarray:
    """MaxVio per layer: ``(max - mean) / mean``; 0 is perfect balance (NaN for an empty layer)."""
    mean = _mean(counts)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (counts.max(axis=1) - mean) / mean


def normalized_entropy(counts: np.ndarray) -> np.ndarray:
    """Entropy of each layer's load distribution over log(E): 1 is uniform, 0 one expert."""
    total = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = counts / total
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        entropy = -plogp.sum(axis=1) / np.log(counts.shape[1])
    return np.where(total[:, 0] > 0, entropy, np.nan)


def coefficient_of_variation(counts: np.ndarray) -> np.ndarray:
    """Population std over mean of each layer's counts."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return counts.std(axis=1) / _mean(counts)


def dead_experts(counts: np.ndarray) -> np.ndarray:
    """Experts never selected, per layer."""
    return (counts == 0).sum(axis=1)


@dataclass
class LoadStats:
    """Per-layer load figures; every field has shape ``(num_moe_layers,)``."""

    min: np.ndarray
    max: np.ndarray
    mean: np.ndarray
    max_over_mean: np.ndarray
    max_violation: np.ndarray
    normalized_entropy: np.ndarray
    cv: np.ndarray
    dead: np.ndarray


def load_stats(counts: np.ndarray) -> LoadStats:
    """All load figures of a counts array ``(L, E)``."""
    mean = _mean(counts)
    with np.errstate(divide="ignore", invalid="ignore"):
        max_over_mean = counts.max(axis=1) / mean
    return LoadStats(
        min=counts.min(axis=1),
        max=counts.max(axis=1),
        mean=mean,
        max_over_mean=max_over_mean,
        max_violation=max_violation(counts),
        normalized_entropy=normalized_entropy(counts),
        cv=coefficient_of_variation(counts),
        dead=dead_experts(counts),
    )


def summary(trace: Trace) -> dict:
    """What a trace holds, from its table alone (no pass over the rows)."""
    t = trace.requests
    md = trace.metadata
    codes = np.bincount(t["finish_reason"].astype(np.intp))
    reasons = {trace.finish_reason_name(c): int(n) for c, n in enumerate(codes) if n}
    return {
        "model": md["model"],
        "architecture": md["architecture"],
        "layers": trace.num_moe_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "requests": trace.num_requests,
        "prompt_tokens": int(t["prompt_len"].sum()),
        "output_tokens": int(t["output_len"].sum()),
        "rows": trace.num_rows,
        "file_size_bytes": os.path.getsize(trace.path),
        "complete": trace.complete,
        "dropped_records": trace.num_dropped,
        "finish_reasons": reasons,
        "arrays": trace.arrays,
    }
