"""Hand prompts to the engine loop without letting a slow producer stall it.

A prompt file was validated before the run and reads fast, so it is read in
the loop's own thread.  Standard input is a stream whose producer may pause
for minutes: a blocking read in the loop would hold back requests already
read (and a stop signal) until the next line arrives.  So a daemon thread
reads standard input ahead into a bounded queue, and the loop takes what is
ready while the engine has work, and waits only when it has none, in short
slices, so that a stop flag set by a signal handler is seen at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_END = object()


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Intake(Generic[T]):
    """``take(wait_s)``: the next item, None if none came within ``wait_s``, StopIteration at the end.

    An exception raised by the source comes out of ``take`` in its place in
    the sequence, so items read before a bad line are still run.
    """

    def __init__(self, source: Iterator[T], *, threaded: bool, read_ahead: int = 64) -> None:
        self._source = source
        self._queue: queue.Queue | None = None
        if threaded:
            self._queue = queue.Queue(maxsize=read_ahead)
            thread = threading.Thread(target=self._read, name="moetrace-intake", daemon=True)
            thread.start()

    def _read(self) -> None:
        assert self._queue is not None
        try:
            for item in self._source:
                self._queue.put(item)
        except BaseException as exc:  # handed over, raised in the loop's thread
            self._queue.put(_Raised(exc))
            return
        self._queue.put(_END)

    def take(self, wait_s: float = 0.0) -> T | None:
        """A file source is read in place (it never waits); a threaded one waits up to ``wait_s``."""
        if self._queue is None:
            return next(self._source)
        try:
            item = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is _END:
            self._queue.put(_END)  # stays ended for any later call
            raise StopIteration
        if isinstance(item, _Raised):
            raise item.exc
        return item
