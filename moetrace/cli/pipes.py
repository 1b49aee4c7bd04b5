"""Standard output closed early (``moetrace inspect t.h5 | head -1``) is no failure.

The reader has what it wanted, so the command stops writing and exits 0
without a message, as ``cat`` and ``head`` themselves do.  Plain writes raise
``BrokenPipeError``; rich's console catches that itself and would exit 1, so
commands print tables through ``StdoutConsole``.

A command whose exit code is its answer (``diff``: 0 identical, 1 different)
keeps that code when the reader leaves: ``closed_pipe_code``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import typer
from rich.console import Console


def stop_quietly(code: int = 0) -> NoReturn:
    """End the command with ``code`` and no message: standard output has no reader."""
    # Later writes, and the interpreter's last flush, go nowhere instead of failing again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise typer.Exit(code)


class StdoutConsole(Console):
    """A rich console on standard output that stops quietly when the reader has gone."""

    def __init__(self, *args: Any, closed_pipe_code: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed_pipe_code = closed_pipe_code

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stop_quietly(self.closed_pipe_code)


def quiet_on_closed_pipe(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a typer command so a closed standard output ends it with exit code 0."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = command(*args, **kwargs)
            sys.stdout.flush()
        except BrokenPipeError:
            stop_quietly()
        return result

    return run
