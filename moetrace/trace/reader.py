"""Read a trace: request by request, or streaming over rows for traces larger than memory.

A trace that was not closed normally (``complete`` is false) may end in
records whose data never reached the disk; those are checked from the tail on
open and left out, so everything a ``Trace`` returns is backed by data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from moetrace.errors import MoetraceError, install_extra
from moetrace.trace import tokenizer_files
from moetrace.trace.checked_rows import (
    RowChecksums,
    UnreadableDataError,
    damaged,
    damaged_file,
)
from moetrace.trace.file_checks import (
    check_variable_length,
    checked_attributes,
    whole_file_problems,
)
from moetrace.trace.integrity import expected_num_rows, file_problem, plain_value, request_checksum
from moetrace.trace.lock import writer_pid
from moetrace.trace.metadata import FORMAT_NAME, FORMAT_VERSION
from moetrace.trace.output_text import decode_output, load_tokenizer
from moetrace.trace.records import (
    ARRAYS,
    COLUMNS,
    LOGPROBS,
    PLACED,
    REQUESTS,
    ROUTED_EXPERTS,
    ROUTED_WEIGHTS,
    ROWS,
    TOKEN_IDS,
    TOKENS,
    FinishedRequest,
    RecordDecoder,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Root attributes written as JSON text (docs/trace-format.md), with their value when absent.
JSON_ATTRIBUTES = {
    "engine_settings": "{}",
    "skipped_inputs": "[]",
    "resumes": "[]",
    "merged_from": "[]",
}
ITER_ROWS = 65536  # rows read at once when streaming (a few tens of MB for big models)
ITER_TOKENS = 1 << 22  # token ids read at once (16 MiB)


@dataclass(kw_only=True)
class TraceRequest(FinishedRequest):
    """One request as stored: the record the writer got, and where the file keeps it."""

    position: int  # record number in the trace
    row_start: int
    token_start: int
    checksum: int
    # Gives the trace's tokenizer (loaded once, when first asked), for ``output_text``.
    text_tokenizer: Callable[[], Tokenizer | None] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def id(self) -> str:
        """The request id (the table's name for ``request_id``)."""
        return self.request_id

    @property  # type: ignore[override]  (a field of FinishedRequest, decoded here on demand)
    def output_text(self) -> str | None:
        """The output as text, as the engine gave it (trace/output_text.py); None without a
        tokenizer."""
        tok = None if self.text_tokenizer is None else self.text_tokenizer()
        if self._output_text is None and tok is not None:
            self._output_text = decode_output(
                tok,
                self.prompt_token_ids,
                self.output_token_ids,
                finish_reason=self.finish_reason,
                stop_reason=self.stop_reason,
                sampling_params=self.sampling_params,
            )
        return self._output_text

    @output_text.setter
    def output_text(self, value: str | None) -> None:
        self._output_text = value


class Trace:
    """A trace file opened read-only; use as a context manager or call ``close()``."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        self.path = Path(path)
        # Check each request's checksum (and expert ids) as it is read: damaged routing
        # raises DamagedTraceError naming the request instead of reaching a consumer.
        self.verify_reads = verify
        if not self.path.is_file():
            raise MoetraceError(not_a_trace_file(self.path))
        # A run writing it holds its lock (trace/lock.py): what is flushed reads, and the
        # records past it are left out as after a kill; a failed read says why it may fail.
        self.writer_pid = writer_pid(self.path)
        try:
            self._open()
        except MoetraceError as exc:
            if self.writer_pid is None:
                raise
            pid = f" (pid {self.writer_pid})" if self.writer_pid else ""
            raise MoetraceError(
                f"{self.path} is being written by a running moetrace{pid} and did not read "
                f"consistently ({exc}); read it again, or once the run is done"
            ) from None

    def _open(self) -> None:
        if not h5py.is_hdf5(self.path):
            raise MoetraceError(f"not an HDF5 file: {self.path}")
        try:
            # No HDF5 locking: lets `inspect` look at a trace that is still being recorded.
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as exc:
            raise MoetraceError(f"cannot open trace file {self.path}: {exc}") from None
        try:
            self._load()
        except (OSError, RuntimeError, KeyError, ValueError, UnicodeError, TypeError) as exc:
            self._file.close()  # HDF5 or a JSON attribute gave way: a damaged file
            raise MoetraceError(
                f"cannot read {self.path}: it is damaged ({_one_line(exc)}); "
                "'moetrace verify' says more"
            ) from None
        except BaseException:
            self._file.close()
            raise

    def _load(self) -> None:
        f = self._file
        self.metadata: dict = checked_attributes(f.attrs)
        fmt = self.metadata.get("format")
        if fmt != FORMAT_NAME:
            raise MoetraceError(f"not a moetrace trace (format attribute {fmt!r}): {self.path}")
        version = int(self.metadata.get("format_version", 0))
        if version > FORMAT_VERSION:
            raise MoetraceError(
                f"trace format version {version} is newer than this moetrace reads "
                f"({FORMAT_VERSION}); upgrade moetrace: {self.path}"
            )
        # Attributes stored as JSON text come back as what they hold.
        for name, empty in JSON_ATTRIBUTES.items():
            self.metadata[name] = json.loads(self.metadata.get(name) or empty)
        required = [a.name for a in ARRAYS if a.required]
        missing = [name for name in (*required, REQUESTS) if name not in f]
        if missing:
            raise MoetraceError(f"trace lacks dataset(s) {', '.join(missing)}: {self.path}")
        # The flat arrays this file holds, in checksum order.
        self._arrays = [a for a in ARRAYS if a.name in f]
        self._data = {a.name: f[a.name] for a in self._arrays}
        self._routed, self._tokens, table = f[ROUTED_EXPERTS], f[TOKEN_IDS], f[REQUESTS]
        check_variable_length(table.dtype, "the request table")
        try:
            self._decoder = RecordDecoder(table.dtype)
        except ValueError as exc:
            raise MoetraceError(f"{exc}: {self.path}") from None
        self._reason_names = self._decoder.enum_names["finish_reason"]
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
        for name in records.dtype.names:
            if h5py.check_string_dtype(table.dtype[name]) is not None:
                records[name] = [s.decode() if isinstance(s, bytes) else s for s in records[name]]
        self.num_dropped = unreadable  # tail records left out: their data is not on disk
        if not self.complete:
            good = self._trusted_prefix(records)
            self.num_dropped += len(records) - good
            records = records[:good]
        self._table = records
        if self.verify_reads:  # what verify would call damaged is refused here too
            problems = [file_problem(f.attrs, records, self.complete)]
            problems += whole_file_problems(f, records, self.complete)
            if problem := next(filter(None, problems), None):
                raise damaged_file(self.path, problem)
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
    def weights_dtype(self) -> str | None:
        """``"float16"`` or ``"float32"``: how the gate weights are stored; None without them."""
        ds = self._data.get(ROUTED_WEIGHTS)
        return None if ds is None else ds.dtype.name

    @property
    def arrays(self) -> dict[str, str]:
        """The flat datasets the trace holds (trace-format.md), each with its dtype."""
        return {a.name: self._data[a.name].dtype.name for a in self._arrays}

    @property
    def has_logprobs(self) -> bool:
        """Whether the trace holds output tokens' log-probabilities."""
        return LOGPROBS in self._data

    @property
    def requests(self) -> np.ndarray:
        """The request table as a structured array (``id`` and ``extra`` as str, reasons as codes)."""
        return self._table

    @property
    def request_ids(self) -> list[str]:
        return self._table["id"].tolist()

    @property
    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer's files the trace carries (tokenizer.json, its config), by name.

        Empty for a trace written before they were stored: then only the root
        attribute ``tokenizer`` (a path on the machine that recorded) names it.
        """
        return tokenizer_files.read(self._file)

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer the trace carries (else the one at the path it names), or None."""
        return load_tokenizer(self.tokenizer_files, self.metadata.get("tokenizer") or None)

    def _tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    @property
    def sample_indices(self) -> np.ndarray:
        """Each record's sample index (several samples of one prompt); zeros in older files."""
        if "sample_index" in (self._table.dtype.names or ()):
            return self._table["sample_index"].astype(np.int64)
        return np.zeros(len(self._table), dtype=np.int64)

    def finish_reason_name(self, code: int) -> str:
        return self._reason_names[int(code)]

    def __len__(self) -> int:
        return self.num_requests

    # -- requests ------------------------------------------------------------

    def request(self, key: int | str | tuple[str, int]) -> TraceRequest:
        """Request by record number (negative counts from the end), by request id, or by
        ``(id, sample_index)`` (an id alone is its sample 0: the only one unless ``n`` > 1)."""
        pos = self._position(key)
        return self._make(pos, self._read_slices(self._table[pos]), self.verify_reads)

    def _position(self, key: int | str | tuple[str, int]) -> int:
        if isinstance(key, (str, tuple)):
            rid, sample = (key, 0) if isinstance(key, str) else key
            if self._positions is None:
                self._positions = {}
                samples = self.sample_indices.tolist()
                for i, (r, k) in enumerate(zip(self._table["id"], samples, strict=True)):
                    self._positions.setdefault((r, k), i)
            if (rid, sample) not in self._positions:
                which = f"id {rid!r}" + (f" sample {sample}" if sample else "")
                raise KeyError(f"no request with {which} in {self.path}")
            return self._positions[rid, sample]
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"a request is found by position, id or (id, sample), not {key!r}")
        pos = int(key) + (self.num_requests if key < 0 else 0)
        if not 0 <= pos < self.num_requests:
            raise IndexError(f"request {key} out of range ({self.num_requests} requests)")
        return pos

    def __getitem__(self, key: int | str | tuple[str, int] | slice):
        """``trace[i]``, ``trace["id"]``, ``trace["id", 2]``; a slice gives a list, file order."""
        if isinstance(key, slice):
            return [self.request(i) for i in range(*key.indices(self.num_requests))]
        return self.request(key)

    def __contains__(self, key: object) -> bool:
        try:
            self._position(key)  # type: ignore[arg-type]
        except (KeyError, IndexError, TypeError):
            return False
        return True

    def in_input_order(self) -> Iterator[TraceRequest]:
        """The requests in the order of the input (``index``, then ``sample_index``).

        Iterating the trace itself gives file order (as requests finished),
        reading many at once; this reads one request at a time.
        """
        keys = np.lexsort((self.sample_indices, self._table["index"]))
        for pos in keys.tolist():
            yield self.request(pos)

    def to_pandas(self):
        """The request table as a ``pandas.DataFrame``, one row per request, file order.

        Columns: id, sample_index, index, prompt_len, output_len, num_rows,
        finish_reason (its name), num_cached_tokens, num_preemptions, extra (a
        dict) and the offsets row_start and token_start, then any column
        declared since in ``trace/records.py`` (its default where the file
        predates it); the index is the record number.  Needs pandas
        (the ``pandas`` extra).
        """
        try:
            import pandas as pd
        except ImportError:
            raise MoetraceError(
                f"Trace.to_pandas needs pandas: {install_extra('pandas')}"
            ) from None
        t = self._table
        columns = {
            "id": t["id"].tolist(),
            "sample_index": self.sample_indices,
            "index": t["index"],
            "prompt_len": t["prompt_len"],
            "output_len": t["output_len"],
            "num_rows": t["num_rows"],
            "finish_reason": [self._reason_names[int(c)] for c in t["finish_reason"]],
            "num_cached_tokens": t["num_cached_tokens"],
            "num_preemptions": t["num_preemptions"],
            "extra": [json.loads(x) if x else {} for x in t["extra"]],
            "row_start": t["row_start"],
            "token_start": t["token_start"],
        }
        held = t.dtype.names or ()
        for column in COLUMNS:  # a field declared later comes along without an edit here
            if column.name in columns or column.kind == PLACED:
                continue
            columns[column.name] = (
                [column.from_table(plain_value(v)) for v in t[column.name].tolist()]
                if column.name in held
                else [column.default_value for _ in range(len(t))]
            )
        return pd.DataFrame(columns, index=pd.RangeIndex(len(t), name="record"))

    def _read_slices(self, rec: np.void) -> dict[str, np.ndarray]:
        """One record's slice of every array the file holds, each read on its own."""
        r0, t0 = int(rec["row_start"]), int(rec["token_start"])
        extents = {
            ROWS: (r0, r0 + int(rec["num_rows"])),
            TOKENS: (t0, t0 + int(rec["prompt_len"]) + int(rec["output_len"])),
        }
        return {a.name: self._read(a.name, *extents[a.along]) for a in self._arrays}

    def __iter__(self) -> Iterator[TraceRequest]:
        """All requests in record order, reading the data of many requests in one slice."""
        return self._iter_requests(self.verify_reads)

    def _iter_requests(self, check: bool) -> Iterator[TraceRequest]:
        t = self._table
        bounds = {
            ROWS: (t["row_start"], self._row_end),
            TOKENS: (t["token_start"], self._token_end),
        }
        i = 0
        while i < len(t):
            j = i + 1
            while j < len(t) and self._row_end[j] - t["row_start"][i] <= ITER_ROWS:
                j += 1
            windows = {}
            for a in self._arrays:
                starts, ends = bounds[a.along]
                lo = int(starts[i])
                windows[a.name] = (lo, self._read(a.name, lo, max(lo, int(ends[j - 1]))))
            for p in range(i, j):
                slices: dict[str, np.ndarray] | None = {}
                for a in self._arrays:
                    starts, ends = bounds[a.along]
                    lo, data = windows[a.name]
                    s0, s1 = int(starts[p]) - lo, int(ends[p]) - lo
                    if not 0 <= s0 <= s1 <= len(data):  # out of order: only in a damaged file
                        slices = None
                        break
                    slices[a.name] = data[s0:s1]
                if slices is None:
                    slices = self._read_slices(t[p])
                yield self._make(p, slices, check)
            i = j

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name[start:stop]``; what HDF5 cannot read (a damaged chunk) is one line."""
        try:
            return self._data[name][start:stop]
        except (OSError, RuntimeError, ValueError) as exc:
            raise UnreadableDataError(
                f"{self.path}: {name}[{start}:{stop}] cannot be read, the file is damaged "
                f"({_one_line(exc)})"
            ) from None

    def _make(self, pos: int, slices: dict[str, np.ndarray], check: bool) -> TraceRequest:
        rec = self._table[pos]
        if check and (problem := self._layout_problem(rec) or self._data_problem(rec, slices)):
            raise damaged(self.path, pos, str(rec["id"]), problem)
        fields = self._decoder.fields(rec)
        for a in self._arrays:
            fields.update(a.fields(slices[a.name], int(rec["prompt_len"])))
        return TraceRequest(position=pos, text_tokenizer=self._tokenizer, **fields)

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
            tokens = self._read(TOKEN_IDS, t0, max(t0, int(ends[j - 1])))
            for p in range(i, j):
                s0 = int(starts[p]) - t0
                yield t["id"][p], tokens[s0 : s0 + int(t["prompt_len"][p])]
            i = j

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the flat ``routed_experts`` array (numbered as ``row_start``)."""
        return self._read(ROUTED_EXPERTS, start, stop)

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Entries ``start:stop`` of the flat ``token_ids`` array (numbered as ``token_start``)."""
        return self._read(TOKEN_IDS, start, stop)

    @property
    def chunk_rows(self) -> int:
        """Rows per stored chunk of ``routed_experts``: reads aligned to it touch fewest chunks."""
        return int(self._routed.chunks[0]) if self._routed.chunks else 1

    @property
    def compression(self) -> str | None:
        """The HDF5 filter the rows are compressed with (``"gzip"``), None if stored plain."""
        return self._routed.compression

    def iter_row_chunks(self, chunk_rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """``(row_start, rows)`` over every request row, in slices aligned to the file's chunks.

        Checked as read (``verify``): a request's checksum is checked when its last
        row has been read, before the chunk that holds it is handed out.
        """
        return self.iter_row_ranges([(0, self.num_rows)], chunk_rows)

    def iter_row_ranges(
        self, ranges: Iterable[tuple[int, int]], chunk_rows: int | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(row_start, rows)`` over row ranges that each start and end at request bounds."""
        if chunk_rows is None:
            chunk_rows = max(1, ITER_ROWS // self.chunk_rows) * self.chunk_rows
        checks = self._row_checksums() if self.verify_reads else None
        for lo, hi in ranges:
            for start in range(lo, hi, chunk_rows):
                rows = self._read(ROUTED_EXPERTS, start, min(start + chunk_rows, hi))
                if checks is not None:
                    checks.feed(start, rows)
                yield start, rows

    def _row_checksums(self) -> RowChecksums:
        layout = self.layout_problems()
        bad = next((i for i, problem in enumerate(layout) if problem), None)
        if bad is not None:
            raise damaged(self.path, bad, str(self._table["id"][bad]), layout[bad])
        return RowChecksums(
            self._table,
            self.num_experts,
            self._other_slices,
            lambda i, problem: damaged(self.path, i, str(self._table["id"][i]), problem),
        )

    def _other_slices(self, first: int, last: int) -> list[list[np.ndarray]]:
        """Per request ``first..last``: its slices of every array but the rows, in checksum
        order, each array read in one slice for them all."""
        t = self._table
        bounds = {
            ROWS: (t["row_start"], self._row_end),
            TOKENS: (t["token_start"], self._token_end),
        }
        per_request: list[list[np.ndarray]] = [[] for _ in range(first, last + 1)]
        for a in self._arrays[1:]:
            starts, ends = bounds[a.along]
            lo, hi = int(starts[first]), int(ends[last])
            data = self._read(a.name, lo, hi)
            for k, i in enumerate(range(first, last + 1)):
                per_request[k].append(data[int(starts[i]) - lo : int(ends[i]) - lo])
        return per_request

    # -- integrity -----------------------------------------------------------

    def verify(
        self, *, report_dropped: bool = True, progress: Callable[[], None] | None = None
    ) -> list[str]:
        """Check offsets, row counts, expert ids, every checksum and what only the whole
        file tells (``trace/file_checks.py``); one line per problem.

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
            for req in self._iter_requests(check=False):  # batched: one slice per many requests
                i = req.position
                data = {a.name: a.values(req) for a in self._arrays}
                problem = layout[i] or self._data_problem(t[i], data)
                if problem:
                    found[i] = problem
                beat()
        except OSError:
            # A chunk that cannot be read: check one record at a time to name each one hit.
            found = {i: p for i in range(len(t)) if (p := layout[i] or self._record_problem(t[i]))}
        problems += [f"request {i} ({t[i]['id']!r}): {p}" for i, p in sorted(found.items())]
        return problems + whole_file_problems(self._file, t, self.complete)

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

    def _data_problem(self, rec: np.void, data: dict[str, np.ndarray]) -> str:
        """What is wrong with a record's slices of the arrays ("" if nothing)."""
        if request_checksum(*data.values()) != int(rec["checksum"]):
            return "checksum mismatch"
        rows = data[ROUTED_EXPERTS]
        if rows.size and int(rows.max()) >= self.num_experts:
            return f"expert id {int(rows.max())} >= num_experts {self.num_experts}"
        return ""

    def _record_problem(self, rec: np.void) -> str:
        """Layout and data problems of one record, reading its data on its own."""
        problem = self._layout_problem(rec)
        if problem:
            return problem
        try:
            data = self._read_slices(rec)
        except OSError as exc:
            return f"data unreadable: {exc}"
        return self._data_problem(rec, data)

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


def open_trace(path: str | os.PathLike, *, verify: bool = True) -> Trace:
    """Open a trace read-only; ``MoetraceError`` if it is missing, foreign or too new.

    With ``verify`` (the default) every request is checked against its checksum
    as it is read, and a damaged one raises ``DamagedTraceError`` naming it;
    ``verify=False`` reads faster and hands on whatever the file holds.
    """
    return Trace(path, verify=verify)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def not_a_trace_file(path: Path) -> str:
    """What stands at a trace path that is not a regular file, in words."""
    if path.is_dir():
        return f"{path} is a directory, not a trace file"
    if path.exists():
        return f"{path} is not a regular file, so not a trace file"
    return f"no such trace file: {path}"
