"""What a reading command says on standard error about the trace it reads."""

from __future__ import annotations

import sys

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
