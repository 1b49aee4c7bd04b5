"""What ``record``, ``serve`` and ``replay`` do alike around the engine run they start."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from moetrace.errors import MoetraceError


@contextmanager
def trace_run_errors() -> Iterator[None]:
    """A run that writes a trace: a signal ends it with one line and 128 + its number; an
    error after HDF5 could not close the file leaves at once (a normal exit would crash)."""
    from moetrace.signals import Interrupted
    from moetrace.trace.writer import unclosed_traces

    try:
        yield
    except Interrupted as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(exc.exit_code) from None
    except MoetraceError as exc:
        if unclosed_traces():
            print(f"error: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        raise
