"""Each request's checksum, checked while its rows stream past in chunks.

After one byte of ``routed_experts`` changed, ``inspect``, ``export`` and
``open_trace(...).request()`` all read on without a word: only ``verify``
noticed, and damaged routing could reach an R3 trainer.  The reader now
checks a request's checksum as it hands the request out; analyses that read
rows in chunks (the whole trace, or the rows of chosen requests) fold each
chunk into the running CRC of the requests it covers and check each request
when its last row has gone by, so a row is never used after its request is
known to be damaged, and never read twice.

What a check costs is measured in docs/benchmarks.md (``inspect_1m.py``);
``open_trace(path, verify=False)`` and ``--no-verify-checksums`` skip it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.integrity import little_endian_bytes

VERIFY_ADVICE = "'moetrace verify' lists every problem"


class DamagedTraceError(MoetraceError):
    """A request read from a trace is not what was written: refused, naming it.

    The message advises ``moetrace verify`` only: whether the damage may be read
    past depends on who reads (``open_trace(..., verify=False)``, and the
    ``--no-verify-checksums`` of the commands that have it, ``with_advice``).
    """

    def __init__(self, statement: str, problem: str = "") -> None:
        super().__init__(f"{statement} ({VERIFY_ADVICE})")
        self.statement = statement  # what is wrong and where, without advice
        self.problem = problem or statement  # what is wrong, without where

    def with_advice(self, advice: str) -> DamagedTraceError:
        """The same error, advising ``advice`` beside ``moetrace verify``."""
        error = DamagedTraceError(self.statement, self.problem)
        error.args = (f"{self.statement} ({VERIFY_ADVICE}; {advice})",)
        return error


class UnreadableDataError(DamagedTraceError, OSError):
    """HDF5 could not read a slice (a damaged chunk); an OSError for callers that go on."""


def damaged_file(path, problem: str) -> DamagedTraceError:
    return DamagedTraceError(f"{path} is damaged: {problem}", problem)


def damaged(path, position: int, request_id: str, problem: str) -> DamagedTraceError:
    return DamagedTraceError(
        f"{path}: request {position} ({request_id!r}) is damaged: {problem}; "
        "nothing after it is handed on",
        f"request {position} ({request_id!r}) is damaged: {problem}",
    )


class RowChecksums:
    """Folds ``(row_start, rows)`` chunks, read in row order, into per-request checksums.

    ``finish(first, last)`` returns, for the requests ``first..last`` whose
    rows are complete, their slices of the other arrays in checksum order
    (tokens, then any optional array), read in one slice per array.
    A chunk may start a new range anywhere a request starts.
    """

    def __init__(
        self,
        table: np.ndarray,
        num_experts: int,
        finish: Callable[[int, int], list[list[np.ndarray]]],
        fail: Callable[[int, str], DamagedTraceError],
    ) -> None:
        self._start = table["row_start"].astype(np.int64)
        self._end = self._start + table["num_rows"].astype(np.int64)
        self._checksum = table["checksum"]
        self._num_experts = num_experts
        self._finish = finish
        self._fail = fail
        self._next = 0  # first request whose rows are not all seen
        self._crc = 0  # running CRC of that request's rows seen so far
        self._crcs: dict[int, int] = {}  # requests whose rows are all seen, not yet checked
        self._at = 0  # the row a chunk continuing the current one starts at

    def feed(self, start: int, rows: np.ndarray) -> None:
        """Take rows ``start:start + len(rows)``; raise on the first damaged request."""
        if start != self._at:  # a new range: it begins at a request's first row
            self._next = int(np.searchsorted(self._start, start, side="left"))
            if self._next >= len(self._start) or self._start[self._next] != start:
                raise AssertionError(f"row {start} does not start a request")
            self._crc = 0
        end = start + len(rows)
        self._at = end
        if rows.size and int(rows.max()) >= self._num_experts:
            self._expert_out_of_range(start, rows)
        first = self._next
        while self._next < len(self._start) and self._start[self._next] < end:
            i = self._next
            lo, hi = max(int(self._start[i]), start), min(int(self._end[i]), end)
            self._crc = zlib.crc32(little_endian_bytes(rows[lo - start : hi - start]), self._crc)
            if self._end[i] > end:
                break
            self._close(i)
        while self._next < len(self._start) and self._end[self._next] == self._start[self._next]:
            if self._start[self._next] > end:
                break
            self._close(self._next)  # a request without rows (an abort before its first step)
        if self._next > first:
            self._check(first, self._next - 1)

    def _close(self, i: int) -> None:
        self._crcs[i] = self._crc
        self._crc = 0
        self._next = i + 1

    def _check(self, first: int, last: int) -> None:
        others = self._finish(first, last)
        for i, slices in zip(range(first, last + 1), others, strict=True):
            crc = self._crcs.pop(i)
            for array in slices:
                crc = zlib.crc32(little_endian_bytes(array), crc)
            if crc != int(self._checksum[i]):
                raise self._fail(i, "checksum mismatch (its rows or tokens changed after writing)")

    def _expert_out_of_range(self, start: int, rows: np.ndarray) -> None:
        bad = int(np.flatnonzero((rows >= self._num_experts).reshape(len(rows), -1).any(1))[0])
        i = int(np.searchsorted(self._start, start + bad, side="right")) - 1
        value = int(rows[bad].max())
        raise self._fail(max(i, 0), f"expert id {value} >= num_experts {self._num_experts}")
