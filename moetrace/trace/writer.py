"""Stream finished requests into an HDF5 trace from one background thread.

The layout is specified in docs/trace-format.md.  Why it is written this way
(measured, see DESIGN.md section 4):

- one thread owns the open file for the whole run: opening and closing an HDF5
  file holds the GIL for 20-28 ms, dataset writes release it;
- rows are buffered until a chunk is full: partial-chunk writes are ~4x slower;
- a request's record is appended only after its rows and tokens were written
  and flushed, and carries a checksum of them, so a reader can tell which
  records survived a kill.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import zlib
from datetime import datetime, timezone
from pathlib import Path

import h5py
import numpy as np

from moetrace.engine.outputs import FINISH_REASONS, FinishedRequest
from moetrace.errors import MoetraceError
from moetrace.trace.metadata import FORMAT_NAME, FORMAT_VERSION, TraceMetadata

ROUTED_EXPERTS = "routed_experts"
TOKEN_IDS = "token_ids"
REQUESTS = "requests"

TOKEN_DTYPE = np.dtype("<i4")
TOKEN_CHUNK = 16384  # 64 KiB of int32: a token is 4 bytes where its row is L * k ids
REQUEST_CHUNK = 1024
# Oldest on-disk structures that hold our layout: HDF5 >= 1.10 tools can read the
# file, and a killed run leaves no "file open for write" flag that needs h5clear.
LIBVER = ("earliest", "v110")

FINISH_REASON_DTYPE = h5py.enum_dtype(
    {name: code for code, name in enumerate(FINISH_REASONS)}, basetype="u1"
)
REQUEST_DTYPE = np.dtype(
    [
        ("id", h5py.string_dtype()),
        ("index", "<i8"),
        ("prompt_len", "<i4"),
        ("output_len", "<i4"),
        ("num_rows", "<i8"),
        ("row_start", "<i8"),
        ("token_start", "<i8"),
        ("finish_reason", FINISH_REASON_DTYPE),
        ("num_cached_tokens", "<i4"),
        ("num_preemptions", "<i4"),
        ("checksum", "<u4"),
        ("extra", h5py.string_dtype()),
    ]
)


def request_checksum(routed_experts: np.ndarray, token_ids: np.ndarray) -> int:
    """CRC-32 of the request's rows (stored dtype, little-endian, C order) then its int32 tokens."""
    rows = np.ascontiguousarray(routed_experts, dtype=routed_experts.dtype.newbyteorder("<"))
    tokens = np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE)
    return zlib.crc32(tokens, zlib.crc32(rows))


def expected_num_rows(prompt_len: int, output_len: int, finish_reason: str) -> range:
    """Row counts the format allows: the last sampled token is never run through the model."""
    tokens = prompt_len + output_len
    if finish_reason == "abort":
        return range(0, tokens + 1)
    return range(tokens - 1, tokens) if tokens else range(0)


def _root_attrs(metadata: TraceMetadata) -> dict:
    """Root attributes a new trace starts with (counts and ``complete`` are updated later)."""
    from moetrace import __version__

    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
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
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "complete": False,
        "num_requests": 0,
        "num_rows": 0,
        "num_tokens": 0,
    }


class _ChunkAppender:
    """Appends along axis 0 in whole chunks; the tail chunk stays in memory until full.

    A flush writes the unflushed part of the tail but keeps it buffered, so the
    next write of that chunk is again a whole, aligned chunk.
    """

    def __init__(self, ds: h5py.Dataset) -> None:
        self.ds = ds
        self.chunk = ds.chunks[0]
        self.buf = np.empty((self.chunk, *ds.shape[1:]), dtype=ds.dtype)
        self.start = 0  # dataset offset of buf[0], a multiple of self.chunk
        self.fill = 0  # rows in buf
        self.flushed = 0  # rows of buf already in the file

    @property
    def length(self) -> int:
        return self.start + self.fill

    def append(self, data: np.ndarray) -> None:
        n, i = len(data), 0
        if self.fill:
            i = min(self.chunk - self.fill, n)
            self.buf[self.fill : self.fill + i] = data[:i]
            self.fill += i
            if self.fill < self.chunk:
                return
            self._write(self.start, self.buf)
            self.start, self.fill, self.flushed = self.start + self.chunk, 0, 0
        whole = (n - i) // self.chunk * self.chunk
        if whole:
            self._write(self.start, data[i : i + whole])
            self.start, i = self.start + whole, i + whole
        self.fill = n - i
        self.buf[: self.fill] = data[i:]

    def flush(self) -> None:
        if self.fill > self.flushed:
            self._write(self.start + self.flushed, self.buf[self.flushed : self.fill])
            self.flushed = self.fill

    def _write(self, offset: int, data: np.ndarray) -> None:
        end = offset + len(data)
        if self.ds.shape[0] < end:
            self.ds.resize(end, axis=0)
        self.ds[offset:end] = data


_CLOSE = object()


class TraceWriter:
    """Writes a trace from a daemon thread; ``submit`` from the engine, ``close`` at the end.

    Errors raised in the thread come back to the caller at the next ``submit``
    or ``close``.  Arrays of a submitted request must not be modified afterwards.
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
    ) -> None:
        if chunk_rows < 1 or flush_every_requests < 1 or queue_size < 1:
            raise ValueError("chunk_rows, flush_every_requests and queue_size must be >= 1")
        if compression not in (None, "gzip"):
            raise ValueError(f"compression must be None or 'gzip', got {compression!r}")
        self.path = Path(path)
        self.metadata = metadata
        self.chunk_rows = chunk_rows
        self.flush_interval_s = flush_interval_s
        self.flush_every_requests = flush_every_requests
        self.compression = compression
        self.overwrite = overwrite
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._error_raised = False
        self._closed = False
        # Progress, written by the thread only.
        self.written_requests = 0  # taken by the thread: rows buffered or in the file
        self.written_rows = 0
        self.flushed_requests = 0  # records in the file: what a crash keeps

    # -- caller side ---------------------------------------------------------

    def start(self) -> TraceWriter:
        """Create the file and start the thread; raises ``MoetraceError`` if the path is unusable."""
        if self._thread is not None:
            raise RuntimeError("TraceWriter already started")
        try:
            with open(self.path, "wb" if self.overwrite else "xb"):
                pass
        except FileExistsError:
            raise MoetraceError(f"trace file already exists: {self.path}") from None
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
            self.path.unlink(missing_ok=True)
            raise MoetraceError(f"cannot create trace file {self.path}: {self._error}")
        return self

    def submit(self, req: FinishedRequest) -> None:
        """Queue one ended request; blocks while the queue is full."""
        if self._thread is None or self._closed:
            raise RuntimeError("TraceWriter is not running (call start() first, not after close())")
        self._raise_thread_error()
        self._check(req)
        extra = json.dumps(req.extra, sort_keys=True) if req.extra else ""
        self._queue.put((req, extra))

    def close(self, complete: bool = True) -> None:
        """Drain the queue, write everything, mark ``complete`` and close the file."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put((_CLOSE, complete))
            self._thread.join()
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
        if isinstance(err, OSError):
            raise MoetraceError(f"writing trace file {self.path} failed: {err}") from err
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

    # -- writer thread -------------------------------------------------------

    def _run(self) -> None:
        try:
            self._file = self._create()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        failed = False
        try:
            complete = self._loop()
            self._flush()
            if complete:
                self._file.attrs["complete"] = True
        except BaseException as exc:
            self._error, failed = exc, True
        finally:
            try:
                self._file.close()
            except BaseException as exc:
                self._error = self._error or exc
        if failed:
            self._drain()

    def _create(self) -> h5py.File:
        md = self.metadata
        f = h5py.File(self.path, "w", libver=LIBVER)
        try:
            opts = {"compression": "gzip", "compression_opts": 1} if self.compression else {}
            layout = (md.num_moe_layers, md.top_k)
            routed = f.create_dataset(
                ROUTED_EXPERTS,
                shape=(0, *layout),
                maxshape=(None, *layout),
                chunks=(self.chunk_rows, *layout),
                dtype=md.expert_dtype.newbyteorder("<"),
                **opts,
            )
            tokens = f.create_dataset(
                TOKEN_IDS,
                shape=(0,),
                maxshape=(None,),
                chunks=(TOKEN_CHUNK,),
                dtype=TOKEN_DTYPE,
                **opts,
            )
            self._requests = f.create_dataset(
                REQUESTS, shape=(0,), maxshape=(None,), chunks=(REQUEST_CHUNK,), dtype=REQUEST_DTYPE
            )
            f.attrs.update(_root_attrs(md))
            f.flush()
        except BaseException:
            f.close()
            raise
        self._rows = _ChunkAppender(routed)
        self._tokens = _ChunkAppender(tokens)
        self._pending: list[tuple] = []
        return f

    def _loop(self) -> bool:
        """Take requests until the close message; return its ``complete`` flag."""
        deadline = time.monotonic() + self.flush_interval_s
        while True:
            try:
                item, arg = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _CLOSE:
                return arg
            if item is not None:
                self._place(item, arg)
            if len(self._pending) >= self.flush_every_requests or time.monotonic() >= deadline:
                self._flush()
                deadline = time.monotonic() + self.flush_interval_s

    def _place(self, req: FinishedRequest, extra: str) -> None:
        tokens = np.concatenate([req.prompt_token_ids, req.output_token_ids]).astype(
            TOKEN_DTYPE, copy=False
        )
        record = (
            req.request_id,
            req.index,
            req.prompt_len,
            req.output_len,
            req.num_rows,
            self._rows.length,
            self._tokens.length,
            FINISH_REASONS.index(req.finish_reason),
            req.num_cached_tokens,
            req.num_preemptions,
            request_checksum(req.routed_experts, tokens),
            extra,
        )
        self._rows.append(req.routed_experts)
        self._tokens.append(tokens)
        self._pending.append(record)
        self.written_requests += 1
        self.written_rows += req.num_rows

    def _flush(self) -> None:
        """Data first and flushed, then the records that point at it, then flushed again."""
        if not self._pending:
            return
        self._rows.flush()
        self._tokens.flush()
        self._file.flush()
        n = self._requests.shape[0]
        self._requests.resize(n + len(self._pending), axis=0)
        self._requests[n:] = np.array(self._pending, dtype=REQUEST_DTYPE)
        self._pending.clear()
        self._file.attrs.update(
            num_requests=self._requests.shape[0],
            num_rows=self._rows.length,
            num_tokens=self._tokens.length,
        )
        self._file.flush()
        self.flushed_requests = self._requests.shape[0]

    def _drain(self) -> None:
        """After a failure keep emptying the queue so that no submitter blocks forever."""
        while self._queue.get()[0] is not _CLOSE:
            pass
