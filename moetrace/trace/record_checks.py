"""Is a record of an open trace what the writer wrote?  Its counts, offsets, checksum, ids.

The reader asks as it hands each request out (and, in a file not closed
normally, to find the last record backed by its data); ``Trace.verify`` asks
of every record and lists the answers.  The definitions checked (checksums,
the row-count rule) are in ``integrity.py``; what only the whole file can
tell is in ``file_checks.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from moetrace.trace.checked_rows import RowChecksums, damaged
from moetrace.trace.integrity import expected_num_rows, request_checksum
from moetrace.trace.records import ROUTED_EXPERTS, FinishedRequest
from moetrace.trace.stored_arrays import Bounds, StoredArrays


class RecordChecker:
    """The damage checks of one record at a time, over an open trace's stored arrays."""

    def __init__(self, stored: StoredArrays, reason_names: dict[int, str], metadata: dict) -> None:
        self._stored = stored
        self._reason_names = reason_names
        self._metadata = metadata  # the trace's root attributes, read when a check needs them

    @property
    def num_experts(self) -> int:
        return int(self._metadata["num_experts"])

    def layout_problem(self, rec: np.void) -> str:
        """What is wrong with a record's counts and offsets ("" if nothing); reads no data."""
        p, o, n = int(rec["prompt_len"]), int(rec["output_len"]), int(rec["num_rows"])
        r0, t0 = int(rec["row_start"]), int(rec["token_start"])
        reason = self._reason_names.get(int(rec["finish_reason"]))
        if reason is None:
            return f"unknown finish_reason code {int(rec['finish_reason'])}"
        if min(p, o, n, r0, t0) < 0 or n not in expected_num_rows(p, o, reason):
            return f"{n} rows for {p} prompt + {o} output tokens (finish_reason {reason!r})"
        if r0 + n > self._stored.routed.shape[0] or t0 + p + o > self._stored.tokens.shape[0]:
            return "offsets point past the end of the data"
        return ""

    def data_problem(self, rec: np.void, data: dict[str, np.ndarray]) -> str:
        """What is wrong with a record's slices of the arrays ("" if nothing)."""
        if request_checksum(*data.values()) != int(rec["checksum"]):
            return "checksum mismatch"
        rows = data[ROUTED_EXPERTS]
        if rows.size and int(rows.max()) >= self.num_experts:
            return f"expert id {int(rows.max())} >= num_experts {self.num_experts}"
        return ""

    def record_problem(self, rec: np.void) -> str:
        """Layout and data problems of one record, reading its data on its own."""
        problem = self.layout_problem(rec)
        if problem:
            return problem
        try:
            data = self._stored.record_slices(rec)
        except OSError as exc:
            return f"data unreadable: {exc}"
        return self.data_problem(rec, data)

    def trusted_prefix(self, records: np.ndarray) -> int:
        """Number of records kept: drop records from the end until one is backed by its data."""
        n = len(records)
        while n and self.record_problem(records[n - 1]):
            n -= 1
        return n

    def layout_problems(self, table: np.ndarray) -> list[str]:
        """Per record, what is wrong with its counts and offsets ("" if nothing); reads no data."""
        t = table
        csr_rows = np.concatenate([[0], np.cumsum(t["num_rows"])])[: len(t)]
        csr_tokens = np.concatenate([[0], np.cumsum(t["prompt_len"] + t["output_len"])])[: len(t)]
        layout = [self.layout_problem(rec) for rec in t]
        for i in np.flatnonzero((t["row_start"] != csr_rows) | (t["token_start"] != csr_tokens)):
            layout[i] = layout[i] or "offsets are not the running sums of the lengths before it"
        return layout

    def request_problems(
        self,
        table: np.ndarray,
        requests: Iterable[FinishedRequest],
        progress: Callable[[], None] | None = None,
    ) -> list[str]:
        """One line per damaged record; ``requests`` are the table's records in order, as read
        (many at once, unchecked).  ``progress`` is called after each request checked."""
        beat = progress or (lambda: None)
        t = table
        layout = self.layout_problems(t)
        found: dict[int, str] = {}
        try:
            for i, req in enumerate(requests):
                data = {a.name: a.values(req) for a in self._stored.arrays}
                problem = layout[i] or self.data_problem(t[i], data)
                if problem:
                    found[i] = problem
                beat()
        except OSError:
            # A chunk that cannot be read: check one record at a time to name each one hit.
            found = {i: p for i in range(len(t)) if (p := layout[i] or self.record_problem(t[i]))}
        return [f"request {i} ({t[i]['id']!r}): {p}" for i, p in sorted(found.items())]

    def row_checksums(self, table: np.ndarray, bounds: Bounds) -> RowChecksums:
        """Checks for rows streamed in chunks; refuses at once a record whose layout is wrong."""
        path = self._stored.path
        layout = self.layout_problems(table)
        bad = next((i for i, problem in enumerate(layout) if problem), None)
        if bad is not None:
            raise damaged(path, bad, str(table["id"][bad]), layout[bad])
        return RowChecksums(
            table,
            self.num_experts,
            lambda first, last: self._stored.other_slices(bounds, first, last),
            lambda i, problem: damaged(path, i, str(table["id"][i]), problem),
        )
