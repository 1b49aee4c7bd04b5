"""Read a trace: request by request, or streaming over rows for traces larger than memory.

A trace that was not closed normally (``complete`` is false) may end in
records whose data never reached the disk; those are checked from the tail on
open and left out, so everything a ``Trace`` returns is backed by data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from moetrace.engine.outputs import RequestLengths
from moetrace.errors import MoetraceError
from moetrace.trace.integrity import expected_num_rows, plain_value, request_checksum
from moetrace.trace.metadata import FORMAT_NAME, FORMAT_VERSION
from moetrace.trace.writer import REQUESTS, ROUTED_EXPERTS, TOKEN_IDS

ITER_ROWS = 65536  # rows read at once when streaming (a few tens of MB for big models)
ITER_TOKENS = 1 << 22  # token ids read at once (16 MiB)


@dataclass
class TraceRequest(RequestLengths):
    """One request as stored: its tokens and one routing row per token run through the model."""

    id: str
    index: int  # position in the input, as the engine numbered it
    position: int  # record number in the trace
    prompt_token_ids: np.ndarray  # int32
    output_token_ids: np.ndarray  # int32
    routed_experts: np.ndarray  # (num_rows, num_moe_layers, top_k), router order
    finish_reason: str
    num_cached_tokens: int
    num_preemptions: int
    row_start: int
    token_start: int
    checksum: int
    extra: dict = field(default_factory=dict)


class Trace:
    """A trace file opened read-only; use as a context manager or call ``close()``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise MoetraceError(f"no such trace file: {self.path}")
        if not h5py.is_hdf5(self.path):
            raise MoetraceError(f"not an HDF5 file: {self.path}")
        try:
            # No locking: lets `inspect` look at a trace that is still being recorded.
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as exc:
            raise MoetraceError(f"cannot open trace file {self.path}: {exc}") from None
        try:
            self._load()
        except BaseException:
            self._file.close()
            raise

    def _load(self) -> None:
        f = self._file
        fmt = plain_value(f.attrs.get("format"))
        if fmt != FORMAT_NAME:
            raise MoetraceError(f"not a moetrace trace (format attribute {fmt!r}): {self.path}")
        version = int(f.attrs.get("format_version", 0))
        if version > FORMAT_VERSION:
            raise MoetraceError(
                f"trace format version {version} is newer than this moetrace reads "
                f"({FORMAT_VERSION}); upgrade moetrace: {self.path}"
            )
        self.metadata: dict = {k: plain_value(v) for k, v in f.attrs.items()}
        self.metadata["engine_settings"] = json.loads(self.metadata.get("engine_settings") or "{}")
        missing = [name for name in (ROUTED_EXPERTS, TOKEN_IDS, REQUESTS) if name not in f]
        if missing:
            raise MoetraceError(f"trace lacks dataset(s) {', '.join(missing)}: {self.path}")
        self._routed, self._tokens, table = f[ROUTED_EXPERTS], f[TOKEN_IDS], f[REQUESTS]
        self._reason_names = {
            code: name for name, code in h5py.check_enum_dtype(table.dtype["finish_reason"]).items()
        }
        self.complete = bool(self.metadata.get("complete", False))
        unreadable = 0
        try:
            records = table[:]
        except (OSError, ValueError) as exc:
            if self.complete:
                message = " ".join(str(exc).split())
                raise MoetraceError(
                    f"cannot read the request table of {self.path}: {message}"
                ) from None
            records = _readable_prefix(table)
            unreadable = table.shape[0] - len(records)
        for name in ("id", "extra"):
            records[name] = [s.decode() if isinstance(s, bytes) else s for s in records[name]]
        self.num_dropped = unreadable  # tail records left out: their data is not on disk
        if not self.complete:
            good = self._trusted_prefix(records)
            self.num_dropped += len(records) - good
            records = records[:good]
        self._table = records
        self._row_end = records["row_start"] + records["num_rows"]
        self._token_end = records["token_start"] + records["prompt_len"] + records["output_len"]
        self._positions: dict[str, int] | None = None

    def _trusted_prefix(self, records: np.ndarray) -> int:
        """Number of records kept: drop records from the end until one is backed by its data."""
        n = len(records)
        while n and self._record_problem(records[n - 1]):
            n -= 1
        return n

    # -- plain facts ---------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._table)

    @property
    def num_rows(self) -> int:
        """Rows that belong to requests (a killed run may leave a few more in the dataset)."""
        return int(self._row_end[-1]) if len(self._row_end) else 0

    @property
    def num_stored_rows(self) -> int:
        """Rows in the dataset, including any a killed run left after the last record."""
        return int(self._routed.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self._token_end[-1]) if len(self._token_end) else 0

    @property
    def num_moe_layers(self) -> int:
        return int(self.metadata["num_moe_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.metadata["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.metadata["top_k"])

    @property
    def requests(self) -> np.ndarray:
        """The request table as a structured array (``id`` and ``extra`` as str, reasons as codes)."""
        return self._table

    @property
    def request_ids(self) -> list[str]:
        return self._table["id"].tolist()

    def finish_reason_name(self, code: int) -> str:
        return self._reason_names[int(code)]

    def __len__(self) -> int:
        return self.num_requests

    # -- requests ------------------------------------------------------------

    def request(self, key: int | str) -> TraceRequest:
        """Request by record number (negative counts from the end) or by request id."""
        if isinstance(key, str):
            if self._positions is None:
                self._positions = {}
                for i, rid in enumerate(self._table["id"]):
                    self._positions.setdefault(rid, i)
            if key not in self._positions:
                raise KeyError(f"no request with id {key!r} in {self.path}")
            pos = self._positions[key]
        else:
            pos = int(key)
            if pos < 0:
                pos += self.num_requests
            if not 0 <= pos < self.num_requests:
                raise IndexError(f"request {key} out of range ({self.num_requests} requests)")
        rec = self._table[pos]
        r0, t0 = int(rec["row_start"]), int(rec["token_start"])
        rows = self._routed[r0 : r0 + int(rec["num_rows"])]
        tokens = self._tokens[t0 : t0 + int(rec["prompt_len"]) + int(rec["output_len"])]
        return self._make(pos, rows, tokens)

    def __iter__(self) -> Iterator[TraceRequest]:
        """All requests in record order, reading the data of many requests in one slice."""
        t, ends, tok_ends = self._table, self._row_end, self._token_end
        starts, tok_starts = t["row_start"], t["token_start"]
        i = 0
        while i < len(t):
            j = i + 1
            while j < len(t) and ends[j] - starts[i] <= ITER_ROWS:
                j += 1
            r0, t0 = int(starts[i]), int(tok_starts[i])
            r1, t1 = max(r0, int(ends[j - 1])), max(t0, int(tok_ends[j - 1]))
            rows, tokens = self._routed[r0:r1], self._tokens[t0:t1]
            for p in range(i, j):
                if r0 <= starts[p] <= ends[p] <= r1 and t0 <= tok_starts[p] <= tok_ends[p] <= t1:
                    rs, ts = int(starts[p]) - r0, int(tok_starts[p]) - t0
                    yield self._make(
                        p, rows[rs : int(ends[p]) - r0], tokens[ts : int(tok_ends[p]) - t0]
                    )
                else:  # out of order: only in a damaged file
                    yield self.request(p)
            i = j

    def _make(self, pos: int, rows: np.ndarray, tokens: np.ndarray) -> TraceRequest:
        rec = self._table[pos]
        p = int(rec["prompt_len"])
        return TraceRequest(
            id=rec["id"],
            index=int(rec["index"]),
            position=pos,
            prompt_token_ids=tokens[:p],
            output_token_ids=tokens[p:],
            routed_experts=rows,
            finish_reason=self._reason_names[int(rec["finish_reason"])],
            num_cached_tokens=int(rec["num_cached_tokens"]),
            num_preemptions=int(rec["num_preemptions"]),
            row_start=int(rec["row_start"]),
            token_start=int(rec["token_start"]),
            checksum=int(rec["checksum"]),
            extra=json.loads(rec["extra"]) if rec["extra"] else {},
        )

    def iter_prompt_tokens(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(id, prompt_token_ids)`` of every request, reading token ids only (no rows)."""
        t = self._table
        starts, ends = t["token_start"], self._token_end
        i = 0
        while i < len(t):
            j = i + 1
            while j < len(t) and ends[j] - starts[i] <= ITER_TOKENS:
                j += 1
            t0 = int(starts[i])
            tokens = self._tokens[t0 : max(t0, int(ends[j - 1]))]
            for p in range(i, j):
                s0 = int(starts[p]) - t0
                yield t["id"][p], tokens[s0 : s0 + int(t["prompt_len"][p])]
            i = j

    def iter_row_chunks(self, chunk_rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """``(row_start, rows)`` over every request row, in slices aligned to the file's chunks."""
        if chunk_rows is None:
            per = self._routed.chunks[0] if self._routed.chunks else 1
            chunk_rows = max(1, ITER_ROWS // per) * per
        total = self.num_rows
        for start in range(0, total, chunk_rows):
            yield start, self._routed[start : min(start + chunk_rows, total)]

    # -- integrity -----------------------------------------------------------

    def verify(
        self, *, report_dropped: bool = True, progress: Callable[[], None] | None = None
    ) -> list[str]:
        """Check offsets, row counts, expert ids and every checksum; one line per problem.

        ``report_dropped`` adds a line for tail records left out on open (what a
        killed run leaves; ``moetrace verify`` reports that as incompleteness).
        ``progress`` is called after each request checked (a watchdog's heartbeat).
        """
        beat = progress or (lambda: None)
        problems = []
        if self.num_dropped and report_dropped:
            problems.append(
                f"{self.num_dropped} record(s) at the end are not backed by data "
                "(interrupted write) and are left out"
            )
        t = self._table
        layout = self.layout_problems()
        found: dict[int, str] = {}
        try:
            for req in self:  # batched reads: one slice per many requests
                i = req.position
                tokens = np.concatenate([req.prompt_token_ids, req.output_token_ids])
                problem = layout[i] or self._data_problem(t[i], req.routed_experts, tokens)
                if problem:
                    found[i] = problem
                beat()
        except OSError:
            # A chunk that cannot be read: check one record at a time to name each one hit.
            found = {i: p for i in range(len(t)) if (p := layout[i] or self._record_problem(t[i]))}
        problems += [f"request {i} ({t[i]['id']!r}): {p}" for i, p in sorted(found.items())]
        extents = (self._routed.shape[0], self._tokens.shape[0])
        if self.complete and extents != (self.num_rows, self.num_tokens):
            problems.append(
                f"datasets hold {extents[0]} rows and {extents[1]} tokens, "
                f"records account for {self.num_rows} and {self.num_tokens}"
            )
        return problems

    def layout_problems(self) -> list[str]:
        """Per record, what is wrong with its counts and offsets ("" if nothing); reads no data."""
        t = self._table
        csr_rows = np.concatenate([[0], np.cumsum(t["num_rows"])])[: len(t)]
        csr_tokens = np.concatenate([[0], np.cumsum(t["prompt_len"] + t["output_len"])])[: len(t)]
        layout = [self._layout_problem(rec) for rec in t]
        for i in np.flatnonzero((t["row_start"] != csr_rows) | (t["token_start"] != csr_tokens)):
            layout[i] = layout[i] or "offsets are not the running sums of the lengths before it"
        return layout

    def _layout_problem(self, rec: np.void) -> str:
        """What is wrong with a record's counts and offsets ("" if nothing); reads no data."""
        p, o, n = int(rec["prompt_len"]), int(rec["output_len"]), int(rec["num_rows"])
        r0, t0 = int(rec["row_start"]), int(rec["token_start"])
        reason = self._reason_names.get(int(rec["finish_reason"]))
        if reason is None:
            return f"unknown finish_reason code {int(rec['finish_reason'])}"
        if min(p, o, n, r0, t0) < 0 or n not in expected_num_rows(p, o, reason):
            return f"{n} rows for {p} prompt + {o} output tokens (finish_reason {reason!r})"
        if r0 + n > self._routed.shape[0] or t0 + p + o > self._tokens.shape[0]:
            return "offsets point past the end of the data"
        return ""

    def _data_problem(self, rec: np.void, rows: np.ndarray, tokens: np.ndarray) -> str:
        """What is wrong with a record's data ("" if nothing)."""
        if request_checksum(rows, tokens) != int(rec["checksum"]):
            return "checksum mismatch"
        if rows.size and int(rows.max()) >= self.num_experts:
            return f"expert id {int(rows.max())} >= num_experts {self.num_experts}"
        return ""

    def _record_problem(self, rec: np.void) -> str:
        """Layout and data problems of one record, reading its data on its own."""
        problem = self._layout_problem(rec)
        if problem:
            return problem
        r0, t0 = int(rec["row_start"]), int(rec["token_start"])
        try:
            rows = self._routed[r0 : r0 + int(rec["num_rows"])]
            tokens = self._tokens[t0 : t0 + int(rec["prompt_len"]) + int(rec["output_len"])]
        except OSError as exc:
            return f"data unreadable: {exc}"
        return self._data_problem(rec, rows, tokens)

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def _readable_prefix(table: h5py.Dataset) -> np.ndarray:
    """The longest readable start of the request table.

    A write that failed inside HDF5 (disk full) can leave the last flush's
    records pointing at string storage past the end of the file; everything
    flushed before them still reads.
    """
    lo, hi = 0, table.shape[0]  # table[:lo] reads, table[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            table[:mid]
            lo = mid
        except (OSError, ValueError):
            hi = mid
    return table[:lo]


def open_trace(path: str | os.PathLike) -> Trace:
    """Open a trace read-only; ``MoetraceError`` if it is missing, foreign or too new."""
    return Trace(path)
