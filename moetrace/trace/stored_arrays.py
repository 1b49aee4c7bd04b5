"""Read the flat arrays of an open trace: one record's slices, or many records' in one read.

Every record's data is a slice of each flat array (``trace.records.ARRAYS``),
found through its offsets: rows at ``row_start``, tokens at ``token_start``.
Reading the slices of many records at once (one HDF5 call per array and a
few tens of MB) is what makes streaming a large trace fast; a record whose
offsets do not fit the slice read for it (only in a damaged file) is read on
its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import h5py
import numpy as np

from moetrace.trace.checked_rows import RowChecksums, UnreadableDataError
from moetrace.trace.records import ARRAYS, ROUTED_EXPERTS, ROWS, TOKEN_IDS, TOKENS

ITER_ROWS = 65536  # rows read at once when streaming (a few tens of MB for big models)
ITER_TOKENS = 1 << 22  # token ids read at once (16 MiB)

# Per axis (ROWS, TOKENS), each record's start and end along it.
Bounds = dict[str, tuple[np.ndarray, np.ndarray]]


class StoredArrays:
    """The flat datasets of one open trace file, and reads of records' slices of them."""

    def __init__(self, path: Path, file: h5py.File) -> None:
        self.path = path
        self.arrays = [a for a in ARRAYS if a.name in file]  # the ones held, in checksum order
        self.datasets = {a.name: file[a.name] for a in self.arrays}
        self.routed, self.tokens = file[ROUTED_EXPERTS], file[TOKEN_IDS]

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name[start:stop]``; what HDF5 cannot read (a damaged chunk) is one line."""
        try:
            return self.datasets[name][start:stop]
        except (OSError, RuntimeError, ValueError) as exc:
            raise UnreadableDataError(
                f"{self.path}: {name}[{start}:{stop}] cannot be read, the file is damaged "
                f"({one_line(exc)})"
            ) from None

    def record_slices(self, rec: np.void) -> dict[str, np.ndarray]:
        """One record's slice of every array the file holds, each read on its own."""
        r0, t0 = int(rec["row_start"]), int(rec["token_start"])
        extents = {
            ROWS: (r0, r0 + int(rec["num_rows"])),
            TOKENS: (t0, t0 + int(rec["prompt_len"]) + int(rec["output_len"])),
        }
        return {a.name: self.read(a.name, *extents[a.along]) for a in self.arrays}

    def iter_slices(
        self, table: np.ndarray, bounds: Bounds
    ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``(position, slices)`` of every record in order, many records' data read at once."""
        t, row_end = table, bounds[ROWS][1]
        i = 0
        while i < len(t):
            j = i + 1
            while j < len(t) and row_end[j] - t["row_start"][i] <= ITER_ROWS:
                j += 1
            windows = {}
            for a in self.arrays:
                starts, ends = bounds[a.along]
                lo = int(starts[i])
                windows[a.name] = (lo, self.read(a.name, lo, max(lo, int(ends[j - 1]))))
            for p in range(i, j):
                slices: dict[str, np.ndarray] | None = {}
                for a in self.arrays:
                    starts, ends = bounds[a.along]
                    lo, data = windows[a.name]
                    s0, s1 = int(starts[p]) - lo, int(ends[p]) - lo
                    if not 0 <= s0 <= s1 <= len(data):  # out of order: only in a damaged file
                        slices = None
                        break
                    slices[a.name] = data[s0:s1]
                if slices is None:
                    slices = self.record_slices(t[p])
                yield p, slices
            i = j

    def iter_rows(
        self, ranges: Iterable[tuple[int, int]], chunk_rows: int, checks: RowChecksums | None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(row_start, rows)`` over row ranges, ``chunk_rows`` at a time, each chunk fed to
        ``checks`` (which raises on a damaged request) before it is handed out."""
        for lo, hi in ranges:
            for start in range(lo, hi, chunk_rows):
                rows = self.read(ROUTED_EXPERTS, start, min(start + chunk_rows, hi))
                if checks is not None:
                    checks.feed(start, rows)
                yield start, rows

    def other_slices(self, bounds: Bounds, first: int, last: int) -> list[list[np.ndarray]]:
        """Per record ``first..last``: its slices of every array but the rows, in checksum
        order, each array read in one slice for them all."""
        per_request: list[list[np.ndarray]] = [[] for _ in range(first, last + 1)]
        for a in self.arrays[1:]:
            starts, ends = bounds[a.along]
            lo, hi = int(starts[first]), int(ends[last])
            data = self.read(a.name, lo, hi)
            for k, i in enumerate(range(first, last + 1)):
                per_request[k].append(data[int(starts[i]) - lo : int(ends[i]) - lo])
        return per_request

    def iter_prompt_tokens(
        self, table: np.ndarray, bounds: Bounds
    ) -> Iterator[tuple[str, np.ndarray]]:
        """``(id, prompt_token_ids)`` of every record, reading token ids only (no rows)."""
        t = table
        starts, ends = bounds[TOKENS]
        i = 0
        while i < len(t):
            j = i + 1
            while j < len(t) and ends[j] - starts[i] <= ITER_TOKENS:
                j += 1
            t0 = int(starts[i])
            tokens = self.read(TOKEN_IDS, t0, max(t0, int(ends[j - 1])))
            for p in range(i, j):
                s0 = int(starts[p]) - t0
                yield t["id"][p], tokens[s0 : s0 + int(t["prompt_len"][p])]
            i = j


def bounds_of(table: np.ndarray) -> Bounds:
    """Where each record's slices lie along the rows and along the tokens."""
    return {
        ROWS: (table["row_start"], table["row_start"] + table["num_rows"]),
        TOKENS: (
            table["token_start"],
            table["token_start"] + table["prompt_len"] + table["output_len"],
        ),
    }


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, cut to 200 characters (h5py's span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
