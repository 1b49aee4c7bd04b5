"""Stream finished requests into an HDF5 trace from one background thread.

The engine ``submit``s each ended request; the thread takes whatever has
queued up as one batch and hands it to the ``TraceFile`` it owns
(``trace_file.py``: the layout, placing records, flushes, the disk-space
reserve).  Errors raised in the thread come back to the caller at the next
``submit`` or ``close``; after one the thread keeps emptying the queue, so no
caller blocks forever.

In append mode (``moetrace record --resume``) the writer reopens a trace,
cuts it back to the records that are backed by data and continues the CSR
offsets from there, so a resumed file has the layout of an uninterrupted one.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

from moetrace.errors import MoetraceError
from moetrace.output_files import check_replaceable
from moetrace.trace.diskspace import (
    RESERVE_ENV,
    DiskFullError,
    free_bytes,
    is_disk_full,
    one_line_cause,
    reserve_from_env,
)
from moetrace.trace.integrity import expected_num_rows
from moetrace.trace.lock import TraceLock
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.records import (
    COLUMNS,
    FINISH_REASONS,
    ROWS,
    FinishedRequest,
    FlatArray,
    encode_fields,
    unstorable,
    written_arrays,
)
from moetrace.trace.trace_file import TraceFile

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
        self._columns = COLUMNS  # of the table written to (the thread's TraceFile says)
        # Built under a temporary name and renamed once its header is on disk, so that a
        # kill at any moment leaves either no trace or one that opens.
        self._creating = self.path.with_name(f".{self.path.name}.{os.getpid()}.creating")
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._error_raised = False
        self._closed = False
        self._close_taken = False  # the thread took the close message off the queue
        self._file: TraceFile | None = None  # the thread's, once it has opened the file

    # -- progress: the thread's TraceFile counts, anyone reads ---------------

    @property
    def kept_requests(self) -> int:
        """Records kept from an earlier run (append mode)."""
        return self._file.kept_requests if self._file else 0

    @property
    def written_requests(self) -> int:
        """Requests taken by the thread: rows buffered or in the file."""
        return self._file.written_requests if self._file else 0

    @property
    def written_rows(self) -> int:
        return self._file.written_rows if self._file else 0

    @property
    def flushed_requests(self) -> int:
        """Records in the file (kept ones included): what a crash keeps."""
        return self._file.flushed_requests if self._file else 0

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
        check_request(req, self.metadata, self._arrays)
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

    # -- writer thread -------------------------------------------------------

    def _run(self) -> None:
        try:
            file = self._file = self._open()
            self._columns = file.columns
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        error: BaseException | None = None
        try:
            complete, end_reason, skipped = self._loop(file)
            file.flush()
            file.finish(complete, end_reason, skipped)
        except DiskFullError as exc:  # nothing was written past the reserve: close cleanly
            error = exc
            try:
                file.flush()
                file.finish(False, "disk full", None)
            except BaseException:
                pass
        except BaseException as exc:
            error = exc
        finally:
            try:
                file.close()
            except BaseException as exc:
                error = error or exc
                _UNCLOSED.append(self.path)
        # Set last: a caller that sees the error also sees the final flushed count.
        self._error = error
        if error is not None:
            self._drain()

    def _open(self) -> TraceFile:
        if self.append:
            return TraceFile.reopen(
                self.path,
                self.metadata,
                self._arrays,
                keep_requests=self.keep_requests,
                expected_requests=self.expected_requests,
                reserve_bytes=self.reserve_bytes,
            )
        return TraceFile.create(
            self.path,
            self._creating,
            self.metadata,
            self._arrays,
            chunk_rows=self.chunk_rows,
            compression=self.compression,
            expected_requests=self.expected_requests,
            overwrite=self.overwrite,
            reserve_bytes=self.reserve_bytes,
        )

    def _loop(self, file: TraceFile) -> tuple[bool, str, list[dict] | None]:
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
                if file.num_pending + len(batch) >= self.flush_every_requests:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if item is not None and item[0] is _CLOSE:
                self._close_taken = True  # a failure below must not wait for it again
            if batch:
                file.place(batch)
            if self._close_taken:
                return item[1]
            if file.num_pending >= self.flush_every_requests or time.monotonic() >= deadline:
                file.flush()
                deadline = time.monotonic() + self.flush_interval_s

    def _drain(self) -> None:
        """After a failure keep emptying the queue so that no submitter blocks forever."""
        while not self._close_taken and self._queue.get()[0] is not _CLOSE:
            pass


def check_request(req: FinishedRequest, md: TraceMetadata, arrays: tuple[FlatArray, ...]) -> None:
    """Refuse a request that would break the format's guarantees (an engine bug)."""
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
    for array in arrays:
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
