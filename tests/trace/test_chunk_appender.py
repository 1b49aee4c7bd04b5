"""ChunkAppender: rows appended in whole chunks come back in order, however they arrive."""

import h5py
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.trace.chunk_appender import ChunkAppender


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=12),
    st.integers(1, 9),
    st.integers(1, 4),
)
def test_chunk_appender_keeps_every_row(steps, chunk, chunks_per_write):
    """Any mix of appends (shorter and longer than a chunk or a write) and flushes leaves the
    rows in order, whatever number of chunks one write holds."""
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        ds = f.create_dataset("d", (0, 2), maxshape=(None, 2), chunks=(chunk, 2), dtype="u2")
        app = ChunkAppender(ds, write_bytes=chunks_per_write * chunk * 4)
        want, n = [], 0
        for size, flush in steps:
            rows = np.arange(n, n + size, dtype="u2").repeat(2).reshape(-1, 2)
            app.append(rows)
            want.append(rows)
            n += size
            if flush:
                app.flush()
                np.testing.assert_array_equal(ds[:], np.concatenate(want))
        app.flush()
        assert app.length == n == ds.shape[0]
        np.testing.assert_array_equal(ds[:], np.arange(n).repeat(2).reshape(-1, 2))
