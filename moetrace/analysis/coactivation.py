"""Which experts fire together: pairs within a layer, and paths between consecutive layers.

Co-activation counts, for each layer, the tokens that select both a and b
among their top-k (a < b).  Transition counts, for consecutive MoE layers l and
l + 1, the tokens that select a at l and b at l + 1 (every one of the k x k
pairs), and separately top-1 -> top-1.  A pair is reported with its count, the
share of tokens, and its lift: count * N / (c_a * c_b), with c the tokens
selecting each expert, i.e. how many times more often than if the two choices
were independent.
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.load import RowBlock
from moetrace.errors import MoetraceError

MAX_PAIR_BYTES = 1 << 30  # E x E counts per layer; refuse rather than swap


def _check_size(num_layers: int, num_experts: int, what: str) -> None:
    size = num_layers * num_experts * num_experts * 8
    if size > MAX_PAIR_BYTES:
        raise MoetraceError(
            f"{what} of {num_layers} layers x {num_experts}^2 expert pairs needs "
            f"{size / 2**30:.1f} GiB; pick fewer layers with --layer"
        )


def _top_pairs(
    counts: np.ndarray, first: np.ndarray, second: np.ndarray, n: int, top: int, by: str
) -> list[dict]:
    """The ``top`` pairs of an (E, E) count matrix by count or by lift (count >= 1 only)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = counts * float(n) / np.outer(first, second)
    key = counts if by == "count" else np.where(counts > 0, lift, -1.0)
    flat = key.ravel()
    nonzero = int((counts > 0).sum())
    top = min(top, nonzero)
    if top == 0:
        return []
    # By key, then count, then ids: ties break the same way on every run.
    idx = np.lexsort((np.arange(flat.size), -counts.ravel(), -flat))[:top]
    e = counts.shape[1]
    return [
        {
            "a": int(i // e),
            "b": int(i % e),
            "count": int(counts.flat[i]),
            "share": float(counts.flat[i] / n) if n else None,
            "lift": float(lift.flat[i]),
        }
        for i in idx
    ]


class CoActivation:
    """Within-layer pair counts (upper triangle) over the top-k sets."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        _check_size(num_layers, num_experts, "co-activation")
        self.num_experts = num_experts
        self.pairs = np.zeros((num_layers, num_experts * num_experts), dtype=np.int64)
        self.members = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.tokens = 0

    def update(self, block: RowBlock) -> None:
        e = self.num_experts
        self.tokens += len(block)
        k = block.rows.shape[2]
        i, j = np.triu_indices(k, 1)
        for layer in range(block.rows.shape[1]):
            s = np.sort(block.rows[:, layer].astype(np.int64), axis=1)
            self.members[layer] += np.bincount(s.ravel(), minlength=e)
            if len(i):
                codes = (s[:, i] * e + s[:, j]).ravel()
                self.pairs[layer] += np.bincount(codes, minlength=e * e)

    def result(self, layers: list[int], top: int = 10, by: str = "count") -> list[dict]:
        out = []
        for i, layer in enumerate(layers):
            upper = np.triu(self.pairs[i].reshape(self.num_experts, self.num_experts), 1)
            out.append(
                {
                    "layer": int(layer),
                    "tokens": int(self.tokens),
                    "pairs": _top_pairs(
                        upper, self.members[i], self.members[i], self.tokens, top, by
                    ),
                }
            )
        return out


class Transitions:
    """Counts from each MoE layer's experts to the next layer's, for the same token."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        steps = max(num_layers - 1, 0)
        _check_size(2 * steps, num_experts, "layer transitions")
        self.num_experts = num_experts
        self.sets = np.zeros((steps, num_experts * num_experts), dtype=np.int64)
        self.top1 = np.zeros((steps, num_experts * num_experts), dtype=np.int64)
        self.members = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.top1_counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.tokens = 0

    def update(self, block: RowBlock) -> None:
        e = self.num_experts
        rows = block.rows
        self.tokens += len(block)
        for layer in range(rows.shape[1]):
            self.members[layer] += np.bincount(rows[:, layer].ravel(), minlength=e)
            self.top1_counts[layer] += np.bincount(rows[:, layer, 0], minlength=e)
        for step in range(rows.shape[1] - 1):
            # one layer pair widened at a time: the whole block as int64 would be 8x its size
            a, b = rows[:, step].astype(np.intp) * e, rows[:, step + 1]  # (n, k)
            for j in range(b.shape[1]):  # k bincounts of (n, k): smaller temporaries, faster
                self.sets[step] += np.bincount((a + b[:, j : j + 1]).ravel(), minlength=e * e)
            self.top1[step] += np.bincount(a[:, 0] + b[:, 0], minlength=e * e)

    def result(self, layers: list[int], top: int = 10, by: str = "count") -> list[dict]:
        e, n = self.num_experts, self.tokens
        out = []
        for step in range(len(layers) - 1):
            sets = self.sets[step].reshape(e, e)
            t1 = self.top1[step].reshape(e, e)
            nxt = self.top1_counts[step + 1]
            out.append(
                {
                    "from_layer": int(layers[step]),
                    "to_layer": int(layers[step + 1]),
                    "tokens": int(n),
                    # Guessing layer l+1's top-1 from layer l's top-1 with the best fixed table.
                    "top1_predictability": float(t1.max(axis=1).sum() / n) if n else None,
                    "top1_chance": float(nxt.max() / n) if n else None,
                    "pairs": _top_pairs(
                        sets, self.members[step], self.members[step + 1], n, top, by
                    ),
                    "top1_pairs": _top_pairs(t1, self.top1_counts[step], nxt, n, top, by),
                }
            )
        return out
