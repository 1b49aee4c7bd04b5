"""Read a trace: request by request, or streaming over rows for traces larger than memory.

A trace that was not closed normally (``complete`` is false) may end in
records whose data never reached the disk; those are checked from the tail on
open and left out, so everything a ``Trace`` returns is backed by data.

``Trace`` answers questions about the file and makes its records into
``TraceRequest``s; what opening reads first is in ``loading.py``, the reads of
the flat arrays in ``stored_arrays.py``, the damage checks of a record in
``record_checks.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace import table_frame, tokenizer_files
from moetrace.trace.checked_rows import damaged, damaged_file
from moetrace.trace.file_checks import check_variable_length, whole_file_problems
from moetrace.trace.integrity import file_problem
from moetrace.trace.loading import read_attributes, read_records
from moetrace.trace.lock import writer_pid
from moetrace.trace.output_text import decode_output, load_tokenizer
from moetrace.trace.record_checks import RecordChecker
from moetrace.trace.records import (
    LOGPROBS,
    REQUESTS,
    ROUTED_EXPERTS,
    ROUTED_WEIGHTS,
    ROWS,
    TOKEN_IDS,
    TOKENS,
    FinishedRequest,
    RecordDecoder,
)
from moetrace.trace.stored_arrays import ITER_ROWS, StoredArrays, bounds_of, one_line

if TYPE_CHECKING:
    from tokenizers import Tokenizer


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
                f"cannot read {self.path}: it is damaged ({one_line(exc)}); "
                "'moetrace verify' says more"
            ) from None
        except BaseException:
            self._file.close()
            raise

    def _load(self) -> None:
        f = self._file
        self.metadata: dict = read_attributes(f, self.path)
        self._stored = StoredArrays(self.path, f)
        table = f[REQUESTS]
        check_variable_length(table.dtype, "the request table")
        try:
            self._decoder = RecordDecoder(table.dtype)
        except ValueError as exc:
            raise MoetraceError(f"{exc}: {self.path}") from None
        self._reason_names = self._decoder.enum_names["finish_reason"]
        self._checker = RecordChecker(self._stored, self._reason_names, self.metadata)
        self.complete = bool(self.metadata.get("complete", False))
        records, self.num_dropped = read_records(
            table, self.path, self.complete, self._checker.trusted_prefix
        )
        self._table = records
        if self.verify_reads:  # what verify would call damaged is refused here too
            problems = [file_problem(f.attrs, records, self.complete)]
            problems += whole_file_problems(f, records, self.complete)
            if problem := next(filter(None, problems), None):
                raise damaged_file(self.path, problem)
        self._bounds = bounds_of(records)
        self._row_end, self._token_end = self._bounds[ROWS][1], self._bounds[TOKENS][1]
        self._positions: dict[str, int] | None = None

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
        return int(self._stored.routed.shape[0])

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
        ds = self._stored.datasets.get(ROUTED_WEIGHTS)
        return None if ds is None else ds.dtype.name

    @property
    def arrays(self) -> dict[str, str]:
        """The flat datasets the trace holds (trace-format.md), each with its dtype."""
        return {a.name: self._stored.datasets[a.name].dtype.name for a in self._stored.arrays}

    @property
    def has_logprobs(self) -> bool:
        """Whether the trace holds output tokens' log-probabilities."""
        return LOGPROBS in self._stored.datasets

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
        return self._make(pos, self._stored.record_slices(self._table[pos]), self.verify_reads)

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
        return table_frame.to_pandas(self._table, self.sample_indices, self._reason_names)

    def __iter__(self) -> Iterator[TraceRequest]:
        """All requests in record order, reading the data of many requests in one slice."""
        return self._iter_requests(self.verify_reads)

    def _iter_requests(self, check: bool) -> Iterator[TraceRequest]:
        for p, slices in self._stored.iter_slices(self._table, self._bounds):
            yield self._make(p, slices, check)

    def _make(self, pos: int, slices: dict[str, np.ndarray], check: bool) -> TraceRequest:
        rec = self._table[pos]
        checker = self._checker
        if check and (problem := checker.layout_problem(rec) or checker.data_problem(rec, slices)):
            raise damaged(self.path, pos, str(rec["id"]), problem)
        fields = self._decoder.fields(rec)
        for a in self._stored.arrays:
            fields.update(a.fields(slices[a.name], int(rec["prompt_len"])))
        return TraceRequest(position=pos, text_tokenizer=self._tokenizer, **fields)

    def iter_prompt_tokens(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(id, prompt_token_ids)`` of every request, reading token ids only (no rows)."""
        yield from self._stored.iter_prompt_tokens(self._table, self._bounds)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the flat ``routed_experts`` array (numbered as ``row_start``)."""
        return self._stored.read(ROUTED_EXPERTS, start, stop)

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Entries ``start:stop`` of the flat ``token_ids`` array (numbered as ``token_start``)."""
        return self._stored.read(TOKEN_IDS, start, stop)

    @property
    def chunk_rows(self) -> int:
        """Rows per stored chunk of ``routed_experts``: reads aligned to it touch fewest chunks."""
        routed = self._stored.routed
        return int(routed.chunks[0]) if routed.chunks else 1

    @property
    def compression(self) -> str | None:
        """The HDF5 filter the rows are compressed with (``"gzip"``), None if stored plain."""
        return self._stored.routed.compression

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
        checks = (
            self._checker.row_checksums(self._table, self._bounds) if self.verify_reads else None
        )
        yield from self._stored.iter_rows(ranges, chunk_rows, checks)

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
        problems = []
        if self.num_dropped and report_dropped:
            problems.append(
                f"{self.num_dropped} record(s) at the end are not backed by data "
                "(interrupted write) and are left out"
            )
        t = self._table
        problems += self._checker.request_problems(t, self._iter_requests(check=False), progress)
        return problems + whole_file_problems(self._file, t, self.complete)

    def layout_problems(self) -> list[str]:
        """Per record, what is wrong with its counts and offsets ("" if nothing); reads no data."""
        return self._checker.layout_problems(self._table)

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def open_trace(path: str | os.PathLike, *, verify: bool = True) -> Trace:
    """Open a trace read-only; ``MoetraceError`` if it is missing, foreign or too new.

    With ``verify`` (the default) every request is checked against its checksum
    as it is read, and a damaged one raises ``DamagedTraceError`` naming it;
    ``verify=False`` reads faster and hands on whatever the file holds.
    """
    return Trace(path, verify=verify)


def not_a_trace_file(path: Path) -> str:
    """What stands at a trace path that is not a regular file, in words."""
    if path.is_dir():
        return f"{path} is a directory, not a trace file"
    if path.exists():
        return f"{path} is not a regular file, so not a trace file"
    return f"no such trace file: {path}"
