"""moetrace: record Mixture-of-Experts routing into HDF5 traces."""

__version__ = "0.1.0"

from moetrace.trace.reader import Trace, open_trace  # noqa: E402

__all__ = ["Trace", "__version__", "open_trace"]
