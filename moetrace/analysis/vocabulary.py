"""Vocabulary specialisation: which tokens an expert takes, which experts a token goes to.

The token of a row is the token that went through the model at that position
(the input token), so a prompt's tokens and every generated token but the last
are counted.  For an expert the figures are, per token id: how often it was
routed there, that count as a share of the expert's tokens, and as a share of
the token's occurrences (how reliably the token goes to that expert).
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.load import RowBlock


def _grow(counts: np.ndarray, size: int) -> np.ndarray:
    if size <= len(counts):
        return counts
    out = np.zeros(max(size, 2 * len(counts)), dtype=np.int64)
    out[: len(counts)] = counts
    return out


class ExpertVocabulary:
    """Token counts of the rows that select one expert at one analysed layer."""

    def __init__(self, column: int, expert: int, vocab_size: int = 0) -> None:
        self.column = column
        self.expert = expert
        self.routed = np.zeros(max(vocab_size, 1), dtype=np.int64)
        self.seen = np.zeros(max(vocab_size, 1), dtype=np.int64)

    def update(self, block: RowBlock) -> None:
        known = block.tokens >= 0  # imported traces may not know every token
        tokens = block.tokens[known].astype(np.int64)
        if not len(tokens):
            return
        hit = (block.rows[known, self.column] == self.expert).any(axis=1)
        size = int(tokens.max()) + 1
        self.routed = _grow(self.routed, size)
        self.seen = _grow(self.seen, size)
        self.seen[:size] += np.bincount(tokens, minlength=size)
        self.routed[:size] += np.bincount(tokens[hit], minlength=size)

    def result(self, layer: int, top: int = 20) -> dict:
        total = int(self.routed.sum())
        order = np.lexsort((np.arange(len(self.routed)), -self.routed))
        order = [int(i) for i in order[:top] if self.routed[i] > 0]
        return {
            "layer": int(layer),
            "expert": int(self.expert),
            "tokens_routed": total,
            "distinct_tokens": int((self.routed > 0).sum()),
            "top_tokens": [
                {
                    "token": i,
                    "count": int(self.routed[i]),
                    "share_of_expert": float(self.routed[i] / total),
                    "share_of_token": float(self.routed[i] / self.seen[i]),
                }
                for i in order
            ],
        }


class TokenExperts:
    """Per-layer expert counts over the rows of one token id."""

    def __init__(self, token: int, num_layers: int, num_experts: int) -> None:
        self.token = token
        self.num_experts = num_experts
        self.counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.occurrences = 0

    def update(self, block: RowBlock) -> None:
        rows = block.rows[block.tokens == self.token]
        self.occurrences += len(rows)
        for layer in range(rows.shape[1]):
            self.counts[layer] += np.bincount(rows[:, layer].ravel(), minlength=self.num_experts)

    def result(self, layers: list[int], top: int = 8) -> dict:
        n = self.occurrences
        out = []
        for i, layer in enumerate(layers):
            c = self.counts[i]
            order = [int(e) for e in np.lexsort((np.arange(len(c)), -c))[:top] if c[e] > 0]
            out.append(
                {
                    "layer": int(layer),
                    "experts": [
                        {"expert": e, "count": int(c[e]), "share_of_token": float(c[e] / n)}
                        for e in order
                    ],
                }
            )
        return {"token": int(self.token), "occurrences": int(n), "layers": out}
