"""A trace open for writing: its layout on disk, the records placed in it, its flushes.

The layout is specified in docs/trace-format.md.  ``TraceWriter``'s thread
owns one ``TraceFile`` for the whole run: opening and closing an HDF5 file
holds the GIL for a long while, dataset writes release it.  Requests queued
together are placed as one batch: their rows and tokens are appended in
whole chunks (``chunk_appender.py``), and their records wait for the next
flush, which writes the data first and only then the records that point at
it, so a reader can tell which records survived a kill.  A running CRC over
the records themselves (``requests_crc32``) lets a verifier notice an edited
table, which the per-request checksums do not cover.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from moetrace._version import __version__
from moetrace.errors import MoetraceError
from moetrace.output_files import check_replaceable
from moetrace.trace import tokenizer_files
from moetrace.trace.chunk_appender import ChunkAppender
from moetrace.trace.diskspace import RESERVE_ENV, DiskFullError, free_bytes
from moetrace.trace.integrity import metadata_crc, record_crc, request_checksum
from moetrace.trace.metadata import FORMAT_NAME, LIBVER, TraceMetadata, utc_now
from moetrace.trace.records import (
    COLUMNS,
    REQUEST_DTYPE,
    REQUESTS,
    ROUTED_EXPERTS,
    ROWS,
    TOKEN_IDS,
    TOKENS,
    FinishedRequest,
    FlatArray,
    format_version_for,
    table_row,
    written_arrays,
)
from moetrace.trace.resume import reopen_for_append

TOKEN_CHUNK = 16384  # 64 KiB of int32: a token is 4 bytes where its row is L * k ids
REQUEST_CHUNK = 1024
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


class TraceFile:
    """An open trace being written: places batches of requests, flushes them, keeps the reserve.

    Built by ``create`` (a new file) or ``reopen`` (a resume); used from one
    thread only.  The progress counters are read by other threads.
    """

    def __init__(
        self,
        file: h5py.File,
        appenders: dict[str, ChunkAppender],
        *,
        path: Path,
        arrays: tuple[FlatArray, ...],
        reserve_bytes: int,
        columns: tuple = COLUMNS,
        table_crc: int = 0,
        kept: int = 0,
    ) -> None:
        self.file = file
        self.path = path
        self.columns = columns  # of the table written to (an older file's may end earlier)
        self._arrays = arrays
        self._appenders = appenders
        self._requests = file[REQUESTS]
        self._reserve_bytes = reserve_bytes
        self._table_crc = table_crc
        self._pending: list[tuple] = []  # records whose data is not flushed yet
        self._room = 0  # free bytes measured at the start of the batch being placed
        # Progress, written by the owning thread only.
        self.kept_requests = kept  # records kept from an earlier run (append mode)
        self.written_requests = 0  # placed: rows buffered or in the file
        self.written_rows = 0
        self.flushed_requests = kept  # records in the file (kept ones included): what a crash keeps

    @classmethod
    def create(
        cls,
        path: Path,
        creating: Path,
        metadata: TraceMetadata,
        arrays: tuple[FlatArray, ...],
        *,
        chunk_rows: int,
        compression: str | None,
        expected_requests: int | None,
        overwrite: bool,
        reserve_bytes: int,
    ) -> TraceFile:
        """Write a new trace's header at ``creating``, then give it the name ``path``."""
        md = metadata
        f = h5py.File(creating, "w", libver=LIBVER, rdcc_nbytes=0)
        try:
            opts = {"compression": "gzip", "compression_opts": 1} if compression else {}
            datasets = {}
            for array in arrays:
                shape = array.shape(md)
                chunk = chunk_rows if array.along == ROWS else TOKEN_CHUNK
                datasets[array.name] = f.create_dataset(
                    array.name,
                    shape=(0, *shape),
                    maxshape=(None, *shape),
                    chunks=(chunk, *shape),
                    dtype=array.dtype(md),
                    **opts,
                )
            f.create_dataset(
                REQUESTS, shape=(0,), maxshape=(None,), chunks=(REQUEST_CHUNK,), dtype=REQUEST_DTYPE
            )
            f.attrs.update(_root_attrs(md))
            tokenizer_files.write(f, md.tokenizer_files)
            if expected_requests is not None:
                f.attrs["expected_requests"] = expected_requests
            f.flush()
            _publish(creating, path, overwrite)
        except BaseException:
            f.close()
            raise
        appenders = {name: ChunkAppender(ds) for name, ds in datasets.items()}
        return cls(f, appenders, path=path, arrays=arrays, reserve_bytes=reserve_bytes)

    @classmethod
    def reopen(
        cls,
        path: Path,
        metadata: TraceMetadata,
        arrays: tuple[FlatArray, ...],
        *,
        keep_requests: int | None,
        expected_requests: int | None,
        reserve_bytes: int,
    ) -> TraceFile:
        """Reopen a trace, cut it back to the kept records and continue after them."""
        cut = reopen_for_append(
            path,
            metadata,
            arrays,
            keep_requests=keep_requests,
            expected_requests=expected_requests,
        )
        ends = {ROWS: cut.row_end, TOKENS: cut.token_end}
        appenders = {a.name: ChunkAppender(cut.file[a.name], ends[a.along]) for a in arrays}
        return cls(
            cut.file,
            appenders,
            path=path,
            arrays=arrays,
            reserve_bytes=reserve_bytes,
            columns=cut.columns,
            table_crc=cut.table_crc,
            kept=cut.kept,
        )

    @property
    def num_pending(self) -> int:
        """Records placed and not yet flushed."""
        return len(self._pending)

    @property
    def _rows(self) -> ChunkAppender:
        return self._appenders[ROUTED_EXPERTS]

    @property
    def _tokens(self) -> ChunkAppender:
        return self._appenders[TOKEN_IDS]

    def place(self, batch: list[tuple[FinishedRequest, dict]]) -> None:
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
                self._pending.append(table_row(encoded, offsets, self.columns))
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
        if room < max(self._reserve_bytes, FLUSH_METADATA_BYTES) + 2 * nbytes + pending:
            raise DiskFullError(
                f"{room:,} bytes free, {self._reserve_bytes:,} kept in reserve "
                f"({RESERVE_ENV} sets it)"
            )

    def flush(self) -> None:
        """Data first and flushed, then the records that point at it, then flushed again."""
        if not self._pending:
            return
        for appender in self._appenders.values():
            appender.flush()
        self.file.flush()
        n = self._requests.shape[0]
        self._requests.resize(n + len(self._pending), axis=0)
        self._requests[n:] = np.array(self._pending, dtype=self._requests.dtype)
        self._table_crc = record_crc(self._pending, self._table_crc)
        self._pending.clear()
        self.file.attrs.update(
            num_requests=self._requests.shape[0],
            num_rows=self._rows.length,
            num_tokens=self._tokens.length,
            requests_crc32=self._table_crc,
        )
        self.file.flush()
        self.flushed_requests = self._requests.shape[0]

    def finish(self, complete: bool, end_reason: str, skipped: list[dict] | None) -> None:
        """Record why the run ended (and the skipped input lines); mark it complete if it is."""
        attrs = {"end_reason": end_reason}
        if skipped is not None:
            attrs["skipped_inputs"] = json.dumps(skipped, ensure_ascii=False)
        self.file.attrs.update(attrs)
        if complete:
            self.file.attrs["complete"] = True
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _publish(creating: Path, path: Path, overwrite: bool) -> None:
    """Give the finished header its real name; never replaces a file unless overwriting."""
    if overwrite:
        check_replaceable(path)  # again: the path may have changed since the writer started
        os.replace(creating, path)
        return
    try:
        os.link(creating, path)
    except FileExistsError:
        raise MoetraceError(f"trace file already exists: {path}") from None
    except OSError:  # no hard links here (some network file systems): rename instead
        if path.exists():
            raise MoetraceError(f"trace file already exists: {path}") from None
        os.rename(creating, path)
        return
    os.unlink(creating)
