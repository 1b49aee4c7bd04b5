"""moetrace: record Mixture-of-Experts routing into HDF5 traces."""

import time as _time

STARTED = _time.perf_counter()  # the start-up summary counts from the package's import
from moetrace._version import __version__  # noqa: E402
from moetrace.trace.reader import Trace, open_trace  # noqa: E402

__all__ = ["Trace", "__version__", "open_trace"]
