"""Ctrl-C and SIGTERM during a recording: stop soon, keep everything finished.

A recording can run for hours, so the first signal must not wait for the
requests in flight (they may need minutes): it asks the loop to stop at the
next step, and the recording then writes every *finished* request, closes
the file (marked incomplete) and exits 130 (SIGINT) or 143 (SIGTERM).
Requests in flight are dropped, not written as ``abort``: an R3 trainer needs
a full row per token, and ``--resume`` redoes exactly the ids that are not in
the file.  A second signal leaves at once; the file then holds what was
flushed before, like after ``kill -9``.

Handlers are installed only by the CLI (``GracefulStop`` as a context
manager); library callers keep Python's default behaviour.  Before the
recording is armed (prompt checks, weight loading) there is nothing to save,
so a signal raises ``Interrupted`` right away.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from moetrace.errors import MoetraceError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(Exception):
    """Raised by a signal inside ``GracefulStop.interruptible()``: leave a blocking read."""


class Interrupted(MoetraceError):
    """A recording stopped by a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class GracefulStop:
    """First signal: ask the loop to stop; second: exit immediately."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self._raise_now = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def arm(self) -> None:
        """From now on a signal stops the loop instead of raising."""
        self.armed = True

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Inside this block a signal raises ``StopNow`` at once instead of waiting."""
        if self.requested:
            raise StopNow
        self._raise_now = True
        try:
            yield
        finally:
            self._raise_now = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal_name(signum)
        if self.signum is not None:
            _say(
                f"{name} again: exiting now; the trace keeps every request flushed before "
                "(check it with 'moetrace verify')"
            )
            os._exit(128 + signum)
        self.signum = signum
        if not self.armed:
            raise Interrupted(signum, f"interrupted by {name} before recording started")
        _say(
            f"{name}: stopping, writing finished requests and closing the trace ({name} again to exit now)"
        )
        if self._raise_now:
            raise StopNow

    def __enter__(self) -> GracefulStop:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _say(line: str) -> None:
    """One line on stderr from a signal handler (os.write: no buffered stream involved)."""
    os.write(2, f"\n{line}\n".encode())
