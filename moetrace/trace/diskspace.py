"""Room on the trace's disk: stop before HDF5 meets a full disk, and name it when it does."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from moetrace import envs
from moetrace.errors import MoetraceError

# Write failures that mean "no room", not "bug": the run stops with a hint to resume.
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# Room kept free on the trace's file system (envs.py): with h5py 3.16 / HDF5 2.0 a failed
# write leaves the file impossible to close, so a run stops while there is still room.
DEFAULT_RESERVE_BYTES = envs.DEFAULT_DISK_RESERVE_BYTES
RESERVE_ENV = "MOETRACE_DISK_RESERVE_BYTES"


class DiskFullError(MoetraceError):
    """The trace's file system (or file size limit) has no room for the next write."""


def is_disk_full(exc: BaseException) -> bool:
    """h5py reports a failed write as OSError or RuntimeError, the errno often only in the text."""
    if isinstance(exc, DiskFullError) or getattr(exc, "errno", None) in _DISK_FULL:
        return True
    text = str(exc)
    return any(f"errno = {code}," in text or os.strerror(code) in text for code in _DISK_FULL)


def free_bytes(path: Path) -> int:
    """Room left for ``path`` to grow: the file system's, and the process's file size limit."""
    if not hasattr(os, "statvfs"):  # not POSIX: no way to ask, so no reserve check
        return 1 << 62
    stat = os.statvfs(path.parent if str(path.parent) else ".")
    room = stat.f_bavail * stat.f_frsize
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        size = path.stat().st_size if path.exists() else 0
        room = min(room, limit - size)
    return room


def reserve_from_env() -> int:
    return envs.get(RESERVE_ENV)


def one_line_cause(exc: BaseException) -> str:
    """One line: h5py messages embed newlines and buffer addresses."""
    text = " ".join(str(exc).split())
    for code in _DISK_FULL:
        if f"errno = {code}," in text:
            return os.strerror(code)
    return text if len(text) <= 200 else text[:197] + "..."
