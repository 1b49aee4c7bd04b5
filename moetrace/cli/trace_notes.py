"""What a reading command says on standard error about the trace it reads."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from moetrace.trace.checked_rows import DamagedTraceError, UnreadableDataError
from moetrace.trace.reader import Trace


def note_if_being_written(trace: Trace) -> None:
    """A trace a run still writes reads up to its last flush: say so, once."""
    if trace.writer_pid is None:
        return
    pid = f" (pid {trace.writer_pid})" if trace.writer_pid else ""
    print(
        f"note: {trace.path} is being written by a running moetrace{pid}: reading the "
        f"{trace.num_requests} requests flushed so far",
        file=sys.stderr,
    )


@contextmanager
def unchecked_read_advice() -> Iterator[None]:
    """For the commands that have ``--no-verify-checksums``: a checksum that fails says that
    the option reads past it (an unreadable chunk stays unreadable, and says nothing)."""
    try:
        yield
    except UnreadableDataError:
        raise
    except DamagedTraceError as exc:
        raise exc.with_advice("--no-verify-checksums reads it unchecked") from None
