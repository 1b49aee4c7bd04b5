"""Temporal locality: does a token reuse the experts of the token before it?

Expert caching and offloading pay off only when consecutive tokens of a
sequence route alike.  For every selected token t >= 1 of a request, compared
with token t - 1 of the same request, per MoE layer:

- top-1 repeat: the first-ranked expert is the same;
- set repeat: the top-k sets are equal;
- overlap: |S_t & S_t-1| / k, the share of experts reused.

Chance is what independent tokens with the same expert frequencies would give:
top-1 sum_e p_e^2 with p_e the share of tokens whose top-1 is e; overlap
sum_e q_e^2 / k with q_e the share of tokens that select e at all.
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.load import RowBlock


class Locality:
    """Counts of repeats between consecutive tokens, per layer."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.pairs = 0
        self.top1_repeats = np.zeros(num_layers, dtype=np.int64)
        self.set_repeats = np.zeros(num_layers, dtype=np.int64)
        self.overlap = np.zeros(num_layers, dtype=np.int64)  # sum of |S_t & S_t-1|
        self.rows = 0  # selected tokens (for the chance marginals)
        self.top1_counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.member_counts = np.zeros((num_layers, num_experts), dtype=np.int64)

    def update(self, block: RowBlock) -> None:
        rows = block.rows
        self.rows += len(block)
        for layer in range(rows.shape[1]):
            self.top1_counts[layer] += np.bincount(rows[:, layer, 0], minlength=self.num_experts)
            self.member_counts[layer] += np.bincount(
                rows[:, layer].ravel(), minlength=self.num_experts
            )
        cur, prev = rows[block.has_prev], block.prev_rows[block.has_prev]
        n = len(cur)
        self.pairs += n
        if not n:
            return
        self.top1_repeats += (cur[:, :, 0] == prev[:, :, 0]).sum(axis=0)
        # Membership tables (n, E) per layer: scatter the ids, then gather the other set's ids.
        # Twice as fast as comparing all k x k pairs, and exact for sets too.
        r = np.arange(n)[:, None]
        in_cur = np.zeros((n, self.num_experts), dtype=bool)
        in_prev = np.zeros((n, self.num_experts), dtype=bool)
        for layer in range(rows.shape[1]):
            a, b = cur[:, layer], prev[:, layer]  # (n, k)
            in_cur[:] = False
            in_prev[:] = False
            in_cur[r, a] = True
            in_prev[r, b] = True
            a_in_prev = in_prev[r, a].sum(axis=1)
            b_in_cur = in_cur[r, b].sum(axis=1)
            self.overlap[layer] += int(a_in_prev.sum())
            k = a.shape[1]  # equal sets: each contains the other
            self.set_repeats[layer] += int(((a_in_prev == k) & (b_in_cur == k)).sum())

    def result(self, layers: list[int] | None = None) -> list[dict]:
        layers = layers if layers is not None else list(range(len(self.top1_repeats)))
        out = []
        n, pairs, k = self.rows, self.pairs, self.top_k
        for i, layer in enumerate(layers):
            p = self.top1_counts[i] / n if n else np.zeros(self.num_experts)
            q = self.member_counts[i] / n if n else np.zeros(self.num_experts)
            chance_top1 = float((p * p).sum()) if n else None
            chance_overlap = float((q * q).sum() / k) if n else None
            top1 = self.top1_repeats[i] / pairs if pairs else None
            overlap = self.overlap[i] / (pairs * k) if pairs else None
            out.append(
                {
                    "layer": int(layer),
                    "pairs": int(pairs),
                    "top1_repeat": _f(top1),
                    "top1_chance": chance_top1,
                    "top1_lift": _ratio(top1, chance_top1),
                    "set_repeat": _f(self.set_repeats[i] / pairs if pairs else None),
                    "overlap": _f(overlap),
                    "overlap_chance": chance_overlap,
                    "overlap_lift": _ratio(overlap, chance_overlap),
                }
            )
        return out


def _f(x) -> float | None:
    return None if x is None else float(x)


def _ratio(a, b) -> float | None:
    return float(a / b) if a is not None and b else None
