"""Stream finished requests into an HDF5 trace from one background thread.

The layout is specified in docs/trace-format.md.  Why it is written this way
(each point measured with h5py on a 2-core machine when the format was chosen):

- one thread owns the open file for the whole run: opening and closing an HDF5
  file holds the GIL for 20-28 ms, dataset writes release it;
- rows are buffered until a chunk is full: partial-chunk writes are ~4x slower;
  whole chunks go out several at a time (``WRITE_BYTES``), past HDF5's chunk
  cache, and requests queued together are placed as one batch: when a
  whole batch of requests ends at once (the end of a uniform run), the
  run waits on these writes, so each h5py call counts;
- a request's record is appended only after its rows and tokens were written
  and flushed, and carries a checksum of them, so a reader can tell which
  records survived a kill;
- a running CRC over the records themselves (``requests_crc32``) lets a
  verifier notice an edited table, which the per-request checksums do not
  cover.

In append mode (``moetrace record --resume``) the writer reopens a trace,
cuts it back to the records that are backed by data and continues the CSR
offsets from there, so a resumed file has the layout of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

import h5py
import numpy as np

from moetrace._version import __version__
from moetrace.errors import MoetraceError
from moetrace.output_files import check_replaceable
from moetrace.trace import tokenizer_files
from moetrace.trace.diskspace import (
    RESERVE_ENV,
    DiskFullError,
    free_bytes,
    is_disk_full,
    one_line_cause,
    reserve_from_env,
)
from moetrace.trace.integrity import expected_num_rows, metadata_crc, record_crc, request_checksum
from moetrace.trace.lock import TraceLock
from moetrace.trace.metadata import FORMAT_NAME, LIBVER, TraceMetadata, utc_now
from moetrace.trace.records import (
    COLUMNS,
    FINISH_REASONS,
    REQUEST_DTYPE,
    REQUESTS,
    ROUTED_EXPERTS,
    ROWS,
    TOKEN_IDS,
    TOKENS,
    FinishedRequest,
    encode_fields,
    format_version_for,
    table_row,
    unstorable,
    written_arrays,
)
from moetrace.trace.resume import reopen_for_append

TOKEN_CHUNK = 16384  # 64 KiB of int32: a token is 4 bytes where its row is L * k ids
REQUEST_CHUNK = 1024
WRITE_BYTES = 4 << 20  # appended rows go to the file in writes of about this size
# What a flush adds besides the data: table chunk, string heap, B-tree nodes, attributes.
FLUSH_METADATA_BYTES = 64 << 10


def _root_attrs(metadata: TraceMetadata) -> dict:
    """Root attributes a new trace starts with (counts and ``complete`` are updated later)."""
    attrs = {
        "format": FORMAT_NAME,
        "format_version": format_version_for(written_arrays(metadata)),
        "model": metadata.model,
        "architecture": metadata.architecture,
        "config_digest": metadata.config_digest,
        "num_hidden_layers": metadata.num_hidden_layers,
        "num_moe_layers": metadata.num_moe_layers,
        "moe_layer_indices": np.asarray(metadata.moe_layer_indices, dtype=np.int64),
        "num_experts": metadata.num_experts,
        "top_k": metadata.top_k,
        "vocab_size": metadata.vocab_size,
        "tokenizer": metadata.tokenizer or "",
        "dtype": metadata.dtype,
        "expert_id_dtype": metadata.expert_dtype.name,
        "row_order": "router",
        "engine_settings": json.dumps(metadata.engine_settings, sort_keys=True),
        "moetrace_version": metadata.moetrace_version or __version__,
        "created": utc_now(),
        "complete": False,
        "end_reason": "recording",
        "num_requests": 0,
        "num_rows": 0,
        "num_tokens": 0,
        "requests_crc32": 0,
        "expected_requests": -1,
        "skipped_inputs": "[]",
        "resumes": "[]",
    }
    attrs["metadata_crc32"] = metadata_crc(attrs)
    return attrs


class _ChunkAppender:
    """Appends along axis 0 in whole, aligned chunks, several per write.

    Rows gather in a buffer of whole chunks (about ``write_bytes``), which goes
    to the file in one write when it is full: one HDF5 call per few megabytes
    rather than per chunk or per request.  A flush writes the unflushed rows
    but keeps the partial tail chunk buffered, so the next write of that chunk
    is again a whole, aligned one.
    """

    def __init__(self, ds: h5py.Dataset, length: int = 0, write_bytes: int = WRITE_BYTES) -> None:
        self.ds = ds
        self.chunk = ds.chunks[0]
        row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
        self.chunk_bytes = self.chunk * row_bytes
        chunks = max(1, write_bytes // self.chunk_bytes)
        self.buf = np.empty((chunks * self.chunk, *ds.shape[1:]), dtype=ds.dtype)
        self.start = length // self.chunk * self.chunk  # dataset offset of buf[0]
        self.fill = length - self.start  # rows in buf
        self.flushed = self.fill  # rows of buf already in the file
        if self.fill:  # appending: the partial tail chunk comes back into the buffer
            self.buf[: self.fill] = ds[self.start : length]

    @property
    def length(self) -> int:
        return self.start + self.fill

    def append(self, data: np.ndarray) -> None:
        n, i = len(data), 0
        while i < n:
            take = min(len(self.buf) - self.fill, n - i)
            self.buf[self.fill : self.fill + take] = data[i : i + take]
            self.fill += take
            i += take
            if self.fill == len(self.buf):
                self._write_buffer(self.fill)

    def flush(self) -> None:
        if self.fill > self.flushed:
            self._write_buffer(self.fill)

    def _write_buffer(self, end: int) -> None:
        """Write ``buf[:end]`` from the chunk holding the first unflushed row; keep the tail chunk."""
        first = self.flushed // self.chunk * self.chunk
        self._write(self.start + first, self.buf[first:end])
        whole = self.fill // self.chunk * self.chunk
        tail = self.fill - whole
        if whole:
            self.buf[:tail] = self.buf[whole : self.fill]
            self.start += whole
        self.fill = tail
        self.flushed = max(0, end - whole)

    def _write(self, offset: int, data: np.ndarray) -> None:
        end = offset + len(data)
        if self.ds.shape[0] < end:
            self.ds.resize(end, axis=0)
        self.ds[offset:end] = data


_CLOSE = object()

# Traces whose HDF5 file could not be closed after a write failure; see unclosed_traces().
_UNCLOSED: list[Path] = []


def unclosed_traces() -> list[Path]:
    """Trace files HDF5 could not close after a failed write.

    Their library state is broken: tearing the interpreter down normally can
    crash inside HDF5, so the CLI leaves with ``os._exit``.  What was flushed
    before the failure is on disk, as after a kill.
    """
    return list(_UNCLOSED)


class TraceWriter:
    """Writes a trace from a daemon thread; ``submit`` from the engine, ``close`` at the end.

    Errors raised in the thread come back to the caller at the next ``submit``
    or ``close``.  Arrays of a submitted request must not be modified afterwards.
    With ``append`` an existing trace is continued after its first
    ``keep_requests`` records (all of them when None); anything after those
    (records, rows, tokens) is cut off first.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        metadata: TraceMetadata,
        *,
        chunk_rows: int = 1024,
        flush_interval_s: float = 5.0,
        flush_every_requests: int = 64,
        queue_size: int = 256,
        compression: str | None = None,
        overwrite: bool = False,
        append: bool = False,
        keep_requests: int | None = None,
        expected_requests: int | None = None,
        reserve_bytes: int | None = None,
        lock: TraceLock | None = None,
        disk_full_hint: str = "free space and rerun with --resume",
    ) -> None:
        if chunk_rows < 1 or flush_every_requests < 1 or queue_size < 1:
            raise ValueError("chunk_rows, flush_every_requests and queue_size must be >= 1")
        if compression not in (None, "gzip"):
            raise ValueError(f"compression must be None or 'gzip', got {compression!r}")
        if append and overwrite:
            raise ValueError("append and overwrite exclude each other")
        self.path = Path(path)
        self.metadata = metadata
        self.chunk_rows = chunk_rows
        self.flush_interval_s = flush_interval_s
        self.flush_every_requests = flush_every_requests
        self.compression = compression
        self.overwrite = overwrite
        self.append = append
        self.keep_requests = keep_requests
        self.expected_requests = expected_requests
        self.reserve_bytes = reserve_from_env() if reserve_bytes is None else reserve_bytes
        self.disk_full_hint = disk_full_hint  # what to do then (serve has no --resume)
        # The caller's lock on the output (held from its own checks on), else one of our own.
        self._lock = lock
        self._own_lock: TraceLock | None = None
        self._arrays = written_arrays(metadata)
        self._columns = COLUMNS  # of the table written to (an older file's may end earlier)
        # Built under a temporary name and renamed once its header is on disk, so that a
        # kill at any moment leaves either no trace or one that opens.
        self._creating = self.path.with_name(f".{self.path.name}.{os.getpid()}.creating")
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._error_raised = False
        self._closed = False
        self._table_crc = 0
        self._close_taken = False  # the thread took the close message off the queue
        self._room = 0  # free bytes measured at the start of the batch being placed
        # Progress, written by the thread only.
        self.kept_requests = 0  # records kept from an earlier run (append mode)
        self.written_requests = 0  # taken by the thread: rows buffered or in the file
        self.written_rows = 0
        self.flushed_requests = 0  # records in the file (kept ones included): what a crash keeps

    # -- caller side ---------------------------------------------------------

    def start(self) -> TraceWriter:
        """Create (or reopen) the file and start the thread; ``MoetraceError`` if unusable."""
        if self._thread is not None:
            raise RuntimeError("TraceWriter already started")
        check_replaceable(self.path)
        if self._lock is None:
            self._own_lock = TraceLock(self.path).acquire()
        try:
            return self._start()
        except BaseException:
            self._release_own_lock()
            raise

    def _release_own_lock(self) -> None:
        if self._own_lock is not None:
            self._own_lock.release()
            self._own_lock = None

    def _start(self) -> TraceWriter:
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if self.reserve_bytes and parent.is_dir() and free_bytes(self.path) < self.reserve_bytes:
            raise DiskFullError(
                f"no room for trace file {self.path}: {free_bytes(self.path):,} bytes free, "
                f"{self.reserve_bytes:,} kept in reserve ({RESERVE_ENV} sets it)"
            )
        if self.append:
            if not self.path.is_file():
                raise MoetraceError(f"cannot resume: no trace file {self.path}")
            if not os.access(self.path, os.R_OK | os.W_OK):
                raise MoetraceError(f"cannot resume {self.path}: the file is not writable")
        else:
            if self.path.is_dir():
                raise MoetraceError(f"cannot create trace file {self.path}: it is a directory")
            if self.path.exists() and not self.overwrite:
                raise MoetraceError(f"trace file already exists: {self.path}")
            try:
                with open(self._creating, "xb"):
                    pass
            except OSError as exc:
                raise MoetraceError(
                    f"cannot create trace file {self.path}: {exc.strerror or exc}"
                ) from None
        self._thread = threading.Thread(target=self._run, name="moetrace-trace-writer", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._error_raised = True
            if self.append:
                raise MoetraceError(f"cannot append to {self.path}: {one_line_cause(self._error)}")
            self._creating.unlink(missing_ok=True)
            if isinstance(self._error, MoetraceError):
                raise self._error
            raise MoetraceError(
                f"cannot create trace file {self.path}: {one_line_cause(self._error)}"
            )
        return self

    def submit(self, req: FinishedRequest) -> None:
        """Queue one ended request; blocks while the queue is full."""
        if self._thread is None or self._closed:
            raise RuntimeError("TraceWriter is not running (call start() first, not after close())")
        self._raise_thread_error()
        self._check(req)
        encoded = encode_fields(req)
        problem = unstorable(encoded, self._columns)
        if problem is not None:
            raise MoetraceError(f"cannot append to {self.path}: {problem}")
        self._queue.put((req, encoded))

    def close(
        self,
        complete: bool = True,
        *,
        end_reason: str | None = None,
        skipped_inputs: list[dict] | None = None,
    ) -> None:
        """Drain the queue, write everything, mark ``complete`` and close the file.

        ``end_reason`` (default "complete" or "stopped") and ``skipped_inputs``
        (input lines left out with ``--skip-invalid``) go to the root attributes.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread is not None and self._thread.is_alive():
                reason = end_reason or ("complete" if complete else "stopped")
                self._queue.put((_CLOSE, (complete, reason, skipped_inputs)))
                self._thread.join()
            self._raise_thread_error()
        finally:
            self._release_own_lock()

    @property
    def healthy(self) -> bool:
        """The thread runs and has met no error: what is submitted will be written."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._error is None
            and not self._closed
        )

    def raise_error(self) -> None:
        """Raise the error that stopped the thread, if any (as the next ``submit`` would)."""
        self._raise_thread_error()

    def __enter__(self) -> TraceWriter:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)

    def _raise_thread_error(self) -> None:
        err = self._error
        if err is None or self._error_raised:
            return
        self._error_raised = True
        if is_disk_full(err):
            raise DiskFullError(
                f"disk full while writing {self.path} ({one_line_cause(err)}): the "
                f"{self.flushed_requests} requests flushed before are safe in it; "
                f"{self.disk_full_hint}"
            ) from err
        if isinstance(err, (OSError, RuntimeError)):  # what h5py raises for I/O failures
            raise MoetraceError(
                f"writing trace file {self.path} failed: {one_line_cause(err)}"
            ) from err
        raise err

    def _check(self, req: FinishedRequest) -> None:
        """Refuse a request that would break the format's guarantees (an engine bug)."""
        md = self.metadata
        rows = req.routed_experts
        shape = (md.num_moe_layers, md.top_k)
        if rows.ndim != 3 or rows.shape[1:] != shape:
            raise ValueError(
                f"request {req.request_id!r}: routed_experts shape {rows.shape}, "
                f"expected (rows, {shape[0]}, {shape[1]})"
            )
        if rows.dtype != md.expert_dtype:
            raise ValueError(
                f"request {req.request_id!r}: routed_experts dtype {rows.dtype}, "
                f"expected {md.expert_dtype}"
            )
        if req.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"request {req.request_id!r}: finish_reason {req.finish_reason!r} "
                f"not in {FINISH_REASONS}"
            )
        for name in ("prompt_token_ids", "output_token_ids"):
            tokens = getattr(req, name)
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise ValueError(f"request {req.request_id!r}: {name} must be a 1-D integer array")
        allowed = expected_num_rows(req.prompt_len, req.output_len, req.finish_reason)
        if req.num_rows not in allowed:
            raise ValueError(
                f"request {req.request_id!r}: {req.num_rows} routing rows for "
                f"{req.prompt_len} prompt + {req.output_len} output tokens "
                f"(finish_reason {req.finish_reason!r})"
            )
        for array in self._arrays:
            if array.required:
                continue
            data = array.values(req)
            length = req.num_rows if array.along == ROWS else req.prompt_len + req.output_len
            want = (length, *array.shape(md))
            if data is None or data.shape != want or data.dtype != array.dtype(md):
                got = "none" if data is None else f"{data.dtype} {data.shape}"
                raise ValueError(
                    f"request {req.request_id!r}: {array.name} is {got}, "
                    f"expected {array.dtype(md)} {want}"
                )

    # -- writer thread -------------------------------------------------------

    def _run(self) -> None:
        try:
            self._file = self._open_append() if self.append else self._create()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        error: BaseException | None = None
        try:
            complete, end_reason, skipped = self._loop()
            self._flush()
            self._finish(complete, end_reason, skipped)
        except DiskFullError as exc:  # nothing was written past the reserve: close cleanly
            error = exc
            try:
                self._flush()
                self._finish(False, "disk full", None)
            except BaseException:
                pass
        except BaseException as exc:
            error = exc
        finally:
            try:
                self._file.close()
            except BaseException as exc:
                error = error or exc
                _UNCLOSED.append(self.path)
        # Set last: a caller that sees the error also sees the final flushed count.
        self._error = error
        if error is not None:
            self._drain()

    def _create(self) -> h5py.File:
        md = self.metadata
        f = h5py.File(self._creating, "w", libver=LIBVER, rdcc_nbytes=0)
        try:
            opts = {"compression": "gzip", "compression_opts": 1} if self.compression else {}
            datasets = {}
            for array in self._arrays:
                shape = array.shape(md)
                chunk = self.chunk_rows if array.along == ROWS else TOKEN_CHUNK
                datasets[array.name] = f.create_dataset(
                    array.name,
                    shape=(0, *shape),
                    maxshape=(None, *shape),
                    chunks=(chunk, *shape),
                    dtype=array.dtype(md),
                    **opts,
                )
            self._requests = f.create_dataset(
                REQUESTS, shape=(0,), maxshape=(None,), chunks=(REQUEST_CHUNK,), dtype=REQUEST_DTYPE
            )
            f.attrs.update(_root_attrs(md))
            tokenizer_files.write(f, md.tokenizer_files)
            if self.expected_requests is not None:
                f.attrs["expected_requests"] = self.expected_requests
            f.flush()
            self._publish()
        except BaseException:
            f.close()
            raise
        self._appenders = {name: _ChunkAppender(ds) for name, ds in datasets.items()}
        self._pending: list[tuple] = []
        return f

    @property
    def _rows(self) -> _ChunkAppender:
        return self._appenders[ROUTED_EXPERTS]

    @property
    def _tokens(self) -> _ChunkAppender:
        return self._appenders[TOKEN_IDS]

    def _publish(self) -> None:
        """Give the finished header its real name; never replaces a file unless overwriting."""
        if self.overwrite:
            check_replaceable(self.path)  # again: the path may have changed since start()
            os.replace(self._creating, self.path)
            return
        try:
            os.link(self._creating, self.path)
        except FileExistsError:
            raise MoetraceError(f"trace file already exists: {self.path}") from None
        except OSError:  # no hard links here (some network file systems): rename instead
            if self.path.exists():
                raise MoetraceError(f"trace file already exists: {self.path}") from None
            os.rename(self._creating, self.path)
            return
        os.unlink(self._creating)

    def _open_append(self) -> h5py.File:
        """Reopen a trace, cut it back to the kept records and continue after them."""
        cut = reopen_for_append(
            self.path,
            self.metadata,
            self._arrays,
            keep_requests=self.keep_requests,
            expected_requests=self.expected_requests,
        )
        self._columns = cut.columns
        self._table_crc = cut.table_crc
        ends = {ROWS: cut.row_end, TOKENS: cut.token_end}
        self._appenders = {
            a.name: _ChunkAppender(cut.file[a.name], ends[a.along]) for a in self._arrays
        }
        self._requests = cut.file[REQUESTS]
        self._pending = []
        self.kept_requests = self.flushed_requests = cut.kept
        return cut.file

    def _loop(self) -> tuple[bool, str, list[dict] | None]:
        """Take requests until the close message; return what it carries.

        Whatever has queued up meanwhile is taken as one batch (up to the next
        flush), so a burst of finished requests costs one write per dataset
        rather than one per request and dataset.
        """
        deadline = time.monotonic() + self.flush_interval_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = None
            batch: list[tuple[FinishedRequest, dict]] = []
            while item is not None and item[0] is not _CLOSE:
                batch.append(item)
                if len(self._pending) + len(batch) >= self.flush_every_requests:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if item is not None and item[0] is _CLOSE:
                self._close_taken = True  # a failure below must not wait for it again
            if batch:
                self._place(batch)
            if self._close_taken:
                return item[1]
            if len(self._pending) >= self.flush_every_requests or time.monotonic() >= deadline:
                self._flush()
                deadline = time.monotonic() + self.flush_interval_s

    def _finish(self, complete: bool, end_reason: str, skipped: list[dict] | None) -> None:
        attrs = {"end_reason": end_reason}
        if skipped is not None:
            attrs["skipped_inputs"] = json.dumps(skipped, ensure_ascii=False)
        self._file.attrs.update(attrs)
        if complete:
            self._file.attrs["complete"] = True
        self._file.flush()

    def _place(self, batch: list[tuple[FinishedRequest, dict]]) -> None:
        """Append a batch of requests: offsets, checksums and records one by one, data at once.

        A request refused for want of space ends the batch; those before it are placed.
        """
        first_row = rows_at = self._rows.length
        tokens_at = self._tokens.length
        placed: list[dict[str, np.ndarray]] = []
        batch_bytes = 0
        try:
            for req, encoded in batch:
                data = {a.name: a.values(req) for a in self._arrays}
                nbytes = sum(d.nbytes for d in data.values())
                self._ensure_space(nbytes + 256, ahead=batch_bytes, requests=len(placed))
                offsets = {
                    "row_start": rows_at,
                    "token_start": tokens_at,
                    "checksum": request_checksum(*data.values()),
                }
                self._pending.append(table_row(encoded, offsets, self._columns))
                placed.append(data)
                batch_bytes += nbytes
                rows_at += req.num_rows
                tokens_at += req.prompt_len + req.output_len
        finally:
            if placed:
                for name, appender in self._appenders.items():
                    for data in placed:
                        appender.append(data[name])
                self.written_requests += len(placed)
                self.written_rows += rows_at - first_row

    def _ensure_space(self, nbytes: int, *, ahead: int = 0, requests: int = 0) -> None:
        """Refuse a write that would eat into the reserve (chunks may be rewritten: count 2x).

        ``ahead``: bytes of the batch placed before this request, not yet in the file.
        With the reserve at 0 the room the next flush needs is still kept: HDF5
        meeting a full disk mid-flush can leave a file that no longer opens, and
        then "the requests flushed before are safe" would not be true.
        """
        if requests == 0:
            self._room = free_bytes(self.path)
        room = self._room - ahead
        pending = (len(self._pending) + 1) * 256 + 2 * self._rows.chunk_bytes
        if room < max(self.reserve_bytes, FLUSH_METADATA_BYTES) + 2 * nbytes + pending:
            raise DiskFullError(
                f"{room:,} bytes free, {self.reserve_bytes:,} kept in reserve "
                f"({RESERVE_ENV} sets it)"
            )

    def _flush(self) -> None:
        """Data first and flushed, then the records that point at it, then flushed again."""
        if not self._pending:
            return
        for appender in self._appenders.values():
            appender.flush()
        self._file.flush()
        n = self._requests.shape[0]
        self._requests.resize(n + len(self._pending), axis=0)
        self._requests[n:] = np.array(self._pending, dtype=self._requests.dtype)
        self._table_crc = record_crc(self._pending, self._table_crc)
        self._pending.clear()
        self._file.attrs.update(
            num_requests=self._requests.shape[0],
            num_rows=self._rows.length,
            num_tokens=self._tokens.length,
            requests_crc32=self._table_crc,
        )
        self._file.flush()
        self.flushed_requests = self._requests.shape[0]

    def _drain(self) -> None:
        """After a failure keep emptying the queue so that no submitter blocks forever."""
        while not self._close_taken and self._queue.get()[0] is not _CLOSE:
            pass
