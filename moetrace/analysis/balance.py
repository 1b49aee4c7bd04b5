"""Per-layer expert load: how evenly each MoE layer spreads its token-expert assignments.

Counts are kept apart for prompt and output rows, since prefill and decode
often route differently and an engine meets them in different batches.
Everything but the counting is a pure function of an ``(L, E)`` counts array.
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.load import RowBlock
from moetrace.trace.stats import counts_from_rows, load_stats


class LoadCounter:
    """Selection counts per (layer, expert), prompt and output rows apart."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self.prompt = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.output = np.zeros((num_layers, num_experts), dtype=np.int64)

    def update(self, block: RowBlock) -> None:
        if block.is_prompt.all():
            self.prompt += counts_from_rows(block.rows, self.num_experts)
        elif not block.is_prompt.any():
            self.output += counts_from_rows(block.rows, self.num_experts)
        else:
            self.prompt += counts_from_rows(block.rows[block.is_prompt], self.num_experts)
            self.output += counts_from_rows(block.rows[~block.is_prompt], self.num_experts)

    @property
    def counts(self) -> np.ndarray:
        return self.prompt + self.output

    def result(self) -> dict:
        return {"counts": self.counts.tolist()}


def gini(counts: np.ndarray) -> np.ndarray:
    """Gini coefficient of each layer's load: 0 is perfect balance, (E-1)/E all on one expert.

    From the sorted loads: G = sum_i (2 i - E - 1) x_(i) / (E sum x), i = 1..E.
    """
    x = np.sort(counts, axis=1).astype(np.float64)
    e = counts.shape[1]
    weights = 2 * np.arange(1, e + 1) - e - 1
    total = x.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (x @ weights) / (e * total)


def shares(counts: np.ndarray) -> np.ndarray:
    """Each expert's share of its layer's assignments (rows sum to 1; NaN for an empty layer)."""
    total = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return counts / total


def total_variation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Total variation distance between two layers' load shares: half the L1 distance, in [0, 1]."""
    return 0.5 * np.abs(shares(a) - shares(b)).sum(axis=1)


def _num(x) -> float | None:
    """A float for JSON, None where the figure is undefined (an empty layer)."""
    x = float(x)
    return None if np.isnan(x) else x


def layer_load(counts: np.ndarray, layers: list[int]) -> list[dict]:
    """All load figures per layer, in the order of ``layers``.

    A layer with no assignments in the selection has no load to describe: its
    figures are None, not zeros (no expert is "dead", none is on top).
    """
    s = load_stats(counts)
    g = gini(counts)
    sh = shares(counts)
    out = []
    for i, layer in enumerate(layers):
        assignments = int(counts[i].sum())
        top = int(np.argmax(counts[i])) if assignments else None
        out.append(
            {
                "layer": int(layer),
                "assignments": assignments,
                "min": int(s.min[i]) if assignments else None,
                "max": int(s.max[i]) if assignments else None,
                "mean": float(s.mean[i]) if assignments else None,
                "max_over_mean": _num(s.max_over_mean[i]),
                "max_violation": _num(s.max_violation[i]),
                "cv": _num(s.cv[i]),
                "gini": _num(g[i]),
                "normalized_entropy": _num(s.normalized_entropy[i]),
                "dead_experts": int(s.dead[i]) if assignments else None,
                "top_expert": top,
                "top_share": None if top is None else _num(sh[i, top]),
            }
        )
    return out


def prompt_vs_output(prompt: np.ndarray, output: np.ndarray, layers: list[int]) -> list[dict]:
    """Per layer, the imbalance of prompt and output rows and how far their load shares differ."""
    sp, so = load_stats(prompt), load_stats(output)
    tv = total_variation(prompt, output)
    return [
        {
            "layer": int(layer),
            "prompt_assignments": int(prompt[i].sum()),
            "output_assignments": int(output[i].sum()),
            "prompt_max_violation": _num(sp.max_violation[i]),
            "output_max_violation": _num(so.max_violation[i]),
            "total_variation": _num(tv[i]),
        }
        for i, layer in enumerate(layers)
    ]
