"""moetrace: record Mixture-of-Experts routing into HDF5 traces."""

from __future__ import annotations

import time as _time

STARTED = _time.perf_counter()  # the start-up summary counts from the package's import
from moetrace._version import __version__  # noqa: E402

__all__ = ["Trace", "__version__", "open_trace"]


def __getattr__(name: str):
    # The reader (h5py, numpy) loads on first use, so the console entry point can
    # install its signal handlers before any heavy import.
    if name in ("Trace", "open_trace"):
        from moetrace.trace import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'moetrace' has no attribute {name!r}")
