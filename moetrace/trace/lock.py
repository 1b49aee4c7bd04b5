"""One writer per trace: an operating-system lock held while a run writes it.

Two ``record`` runs on one output (two ``--overwrite``, or two ``--resume``
on a file another run holds) each went ahead and interleaved or clobbered
the other's work.  The writer now holds an exclusive ``flock`` on a sidecar
file, ``.NAME.lock`` beside the trace, from the output checks until the file
is closed; a second run is refused in one line naming the holder.  The lock
is the kernel's: a run killed with ``kill -9`` leaves at most a stale sidecar,
which the next run takes over.  Readers (``inspect``, ``verify``) test the
same lock to say that a file is still being written.

A sidecar rather than the trace itself, because the trace is replaced by a
rename when it is created (a lock on it would stay with the old inode) and
HDF5 takes its own ``flock`` on the files it opens.  On a file system
without ``flock`` support the run goes ahead unlocked, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path

from moetrace.errors import MoetraceError

_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
# A reader tests the lock by taking it shared for an instant; a writer waits that out.
_PROBE_GRACE_S = 1.0


def lock_path(trace: str | os.PathLike) -> Path:
    path = Path(trace)
    return path.with_name(f".{path.name}.lock")


class TraceLock:
    """``acquire`` before writing ``trace``, ``release`` after closing it."""

    def __init__(self, trace: str | os.PathLike) -> None:
        self.trace = Path(trace)
        self.path = lock_path(trace)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> TraceLock:
        while self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise MoetraceError(
                    f"cannot write {self.trace}: cannot create its lock file {self.path.name} "
                    f"({(exc.strerror or str(exc)).lower()})"
                ) from None
            try:
                _lock_exclusive(fd)
            except OSError as exc:
                holder = _holder(fd)
                os.close(fd)
                if exc.errno in _BUSY:
                    raise MoetraceError(
                        f"{self.trace} is being written by another moetrace run{holder}; "
                        "wait for it to finish (two runs on one trace would mix their records)"
                    ) from None
                return self  # no flock on this file system: unlocked, as before
            # A holder that just released unlinked the file we opened: lock the new one.
            if _identity(fd) == _path_identity(self.path):
                self._fd = fd
            else:
                os.close(fd)
        with contextlib.suppress(OSError):  # the pid is for messages only (a full disk refuses it)
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"{os.getpid()}\n".encode())
        return self

    def release(self) -> None:
        """Unlink the sidecar while still holding it, then let go."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> TraceLock:
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()


def _lock_exclusive(fd: int) -> None:
    """Take the lock, waiting up to ``_PROBE_GRACE_S`` out a reader's probe (``writer_pid``)."""
    deadline = time.monotonic() + _PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in _BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def writer_pid(trace: str | os.PathLike) -> int | None:
    """The pid of the run holding ``trace``'s lock, 0 if unknown, None if nobody writes it."""
    path = lock_path(trace)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() else 0
            return None
        return None  # a stale sidecar: its run is gone
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _path_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
