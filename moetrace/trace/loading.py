"""What opening a trace reads first: its root attributes, and the records backed by data.

A foreign or too-new file is refused here, before any dataset is read.  A
trace that was not closed normally (``complete`` is false) may end in records
whose data never reached the disk, or whose strings lie past the end of the
file (a write that failed inside HDF5); those are left out and counted, so
everything the reader hands out is backed by data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.file_checks import checked_attributes
from moetrace.trace.metadata import FORMAT_NAME, FORMAT_VERSION
from moetrace.trace.records import ARRAYS, REQUESTS

# Root attributes written as JSON text (docs/trace-format.md), with their value when absent.
JSON_ATTRIBUTES = {
    "engine_settings": "{}",
    "skipped_inputs": "[]",
    "resumes": "[]",
    "merged_from": "[]",
}


def read_attributes(f: h5py.File, path: Path) -> dict:
    """The root attributes as plain Python (JSON text as what it holds); ``MoetraceError``
    for a file that is not a moetrace trace, is too new, or lacks a required dataset."""
    metadata = checked_attributes(f.attrs)
    fmt = metadata.get("format")
    if fmt != FORMAT_NAME:
        raise MoetraceError(f"not a moetrace trace (format attribute {fmt!r}): {path}")
    version = int(metadata.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise MoetraceError(
            f"trace format version {version} is newer than this moetrace reads "
            f"({FORMAT_VERSION}); upgrade moetrace: {path}"
        )
    # Attributes stored as JSON text come back as what they hold.
    for name, empty in JSON_ATTRIBUTES.items():
        metadata[name] = json.loads(metadata.get(name) or empty)
    required = [a.name for a in ARRAYS if a.required]
    missing = [name for name in (*required, REQUESTS) if name not in f]
    if missing:
        raise MoetraceError(f"trace lacks dataset(s) {', '.join(missing)}: {path}")
    return metadata


def read_records(
    table: h5py.Dataset, path: Path, complete: bool, trusted_prefix: Callable[[np.ndarray], int]
) -> tuple[np.ndarray, int]:
    """The request table's records a reader keeps (strings as str), and how many it left out.

    In an incomplete file those are the records that do not read and, from the
    end, those that ``trusted_prefix`` finds not backed by their data.
    """
    unreadable = 0
    try:
        records = table[:]
    except (OSError, ValueError) as exc:
        if complete:
            message = " ".join(str(exc).split())
            raise MoetraceError(f"cannot read the request table of {path}: {message}") from None
        records = _readable_prefix(table)
        unreadable = table.shape[0] - len(records)
    for name in records.dtype.names:
        if h5py.check_string_dtype(table.dtype[name]) is not None:
            records[name] = [s.decode() if isinstance(s, bytes) else s for s in records[name]]
    dropped = unreadable  # tail records left out: their data is not on disk
    if not complete:
        good = trusted_prefix(records)
        dropped += len(records) - good
        records = records[:good]
    return records, dropped


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
