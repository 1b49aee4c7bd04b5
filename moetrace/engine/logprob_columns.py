"""A request's per-token log-probabilities, kept as growing arrays rather than one object per token.

Each step hands its sampled tokens' log-probabilities to the host as four
arrays (one row per sampling request); a request copies its row into its own
columns.  So a finished request's ``OutputLogprobs`` is four slices, with no
Python object built per token, and a long batch of requests asking for
log-probabilities adds no per-token garbage for the collector to walk.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moetrace.trace.records import OutputLogprobs


class TokenLogprob(NamedTuple):
    """One sampled token's log-probabilities (host side), as the sampler computed them."""

    logprob: float
    rank: int
    top_ids: np.ndarray  # int32 [N], most likely first
    top_logprobs: np.ndarray  # float32 [N]


class StepLogprobs(NamedTuple):
    """One step's sampled-token log-probabilities on the host, by request id."""

    rows: dict[str, int]  # request id -> row, for the requests that asked for them
    token_logprob: np.ndarray  # float32 [S]
    token_rank: np.ndarray  # int64 [S]
    top_ids: np.ndarray  # int64 [S, M], M >= every asking request's N
    top_logprobs: np.ndarray  # float32 [S, M]


class LogprobColumns:
    """Per output token: log-probability and rank of the sampled token, the top ``num``."""

    def __init__(self, num: int) -> None:
        self.num = num
        self._len = 0
        self._token_logprob = np.empty(0, dtype=np.float32)
        self._token_rank = np.empty(0, dtype=np.int64)
        self._top_ids = np.empty((0, num), dtype=np.int32)
        self._top_logprobs = np.empty((0, num), dtype=np.float32)

    def __len__(self) -> int:
        return self._len

    def append(self, step: StepLogprobs, row: int) -> None:
        """Add the token of ``step``'s row ``row``."""
        n = self._len
        if n == len(self._token_logprob):
            self._grow(max(16, 2 * n))
        self._token_logprob[n] = step.token_logprob[row]
        self._token_rank[n] = step.token_rank[row]
        if self.num:
            self._top_ids[n] = step.top_ids[row, : self.num]
            self._top_logprobs[n] = step.top_logprobs[row, : self.num]
        self._len = n + 1

    def _grow(self, capacity: int) -> None:
        n = self._len
        for name in ("_token_logprob", "_token_rank", "_top_ids", "_top_logprobs"):
            old = getattr(self, name)
            new = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:n] = old[:n]
            setattr(self, name, new)

    def output(self, n: int | None = None) -> OutputLogprobs:
        """Copies of the first ``n`` tokens' values (all when None)."""
        n = self._len if n is None else min(n, self._len)
        return OutputLogprobs(
            token_logprob=self._token_logprob[:n].copy(),
            token_rank=self._token_rank[:n].copy(),
            top_ids=self._top_ids[:n].copy(),
            top_logprobs=self._top_logprobs[:n].copy(),
        )

    def __getitem__(self, index: slice) -> list[TokenLogprob]:
        """Tokens ``index`` as one ``TokenLogprob`` each (what a streaming reply sends)."""
        start, stop, stride = index.indices(self._len)
        return [
            TokenLogprob(
                float(self._token_logprob[i]),
                int(self._token_rank[i]),
                self._top_ids[i],
                self._top_logprobs[i],
            )
            for i in range(start, stop, stride)
        ]
