"""Ctrl-C and SIGTERM at any moment: one line, exit 130 or 143, nothing recorded lost.

A recording can run for hours, so the first signal during a recording must
not wait for the requests in flight (they may need minutes): it asks the loop
to stop at the next step, and the recording then writes every *finished*
request, closes the file (marked incomplete) and exits 130 (SIGINT) or 143
(SIGTERM).  Requests in flight are dropped, not written as ``abort``: an R3
trainer needs a full row per token, and ``--resume`` redoes exactly the ids
that are not in the file.  A second signal leaves at once; the file then
holds what was flushed before, like after ``kill -9``.

No handler here ever raises into the code it interrupts.  A signal is
delivered between two bytecodes of whatever the main thread runs, and an
exception raised there can be swallowed and turned into another by C code
in the middle of an attribute probe: torch building a tensor from a
safetensors storage answered a Ctrl-C during weight loading with
``ValueError: could not determine the shape of object type
'torch.storage.UntypedStorage'`` (3 of 200 tries).  So a handler either sets
a flag that the recording loop polls, or, when there is nothing to save,
prints one line and leaves with ``os._exit`` after the registered clean-ups.

The console entry point installs ``install_exit_handlers`` before any heavy
import, so a signal in the first second (imports, argument checks, weight
loading) or after the trace is closed also ends with one line and 130/143.
Python callers of ``Recording.run`` keep Python's default behaviour unless
they install a ``GracefulStop`` themselves.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from types import FrameType

from moetrace.errors import MoetraceError

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_cleanups: dict[int, Callable[[], None]] = {}
_next_key = itertools.count()
_context = [""]  # appended to the exit line: what the signal interrupted
_owner = [os.getpid()]  # the process whose handlers these are (not a forked child)


class Interrupted(MoetraceError):
    """A recording stopped by a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def on_signal_exit(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` if a signal ends the process; returns the function that unregisters it.

    For what ``os._exit`` would leave behind: child processes, temporary files, lock files.
    """
    key = next(_next_key)
    _cleanups[key] = cleanup

    def forget() -> None:
        _cleanups.pop(key, None)

    return forget


def set_exit_context(text: str) -> None:
    """What the one exit line says the signal interrupted (e.g. "after t.h5 was complete")."""
    _context[0] = text


def leave(signum: int, line: str) -> None:
    """Run the clean-ups, print ``line`` as the one error line, exit with 128 + ``signum``.

    A forked child that kept these handlers (a compile worker) leaves silently: Ctrl-C
    reaches the whole process group, and the one line is the parent's to print.
    """
    if os.getpid() != _owner[0]:
        os._exit(128 + signum)
    for key in sorted(_cleanups, reverse=True):
        cleanup = _cleanups.pop(key, None)
        try:
            if cleanup is not None:
                cleanup()
        except BaseException:  # leaving anyway; one clean-up must not stop the others
            pass
    _say(f"error: {line}")
    os._exit(128 + signum)


def _exit_handler(signum: int, frame: FrameType | None) -> None:
    context = f" {_context[0]}" if _context[0] else ""
    leave(signum, f"interrupted by {signal_name(signum)}{context}")


def install_exit_handlers() -> None:
    """The console's handlers for the whole process: any signal ends it with one line."""
    _owner[0] = os.getpid()
    for sig in SIGNALS:
        signal.signal(sig, _exit_handler)


class GracefulStop:
    """While armed, the first signal asks the loop to stop; before that, and at the second, exit.

    ``armed`` is set once the trace file is about to exist: before it there is
    nothing to save, so a signal leaves at once (after the clean-ups).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self._owner = os.getpid()
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def arm(self) -> None:
        """From now on a signal stops the loop (polled) instead of ending the process."""
        self.armed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal_name(signum)
        if os.getpid() != self._owner:  # a forked child: the parent answers for the group
            os._exit(128 + signum)
        if not self.armed:
            leave(signum, f"interrupted by {name} before recording started (no trace written)")
        if self.signum is not None:
            leave(
                signum,
                f"{name} again: exiting now; the trace keeps every request flushed before "
                "(check it with 'moetrace verify')",
            )
        self.signum = signum
        _say(
            f"{name}: stopping, writing finished requests and closing the trace ({name} again to exit now)"
        )

    def __enter__(self) -> GracefulStop:
        self._owner = os.getpid()
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
