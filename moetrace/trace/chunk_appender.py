"""Append to a growing HDF5 dataset in whole, aligned chunks, several per write.

Partial-chunk writes are about 4x slower than whole ones, and each h5py call
counts when a whole batch of requests ends at once (the end of a uniform
run), so rows gather in memory and go to the file a few megabytes at a time.
"""

from __future__ import annotations

import h5py
import numpy as np

WRITE_BYTES = 4 << 20  # appended rows go to the file in writes of about this size


class ChunkAppender:
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
