"""User-facing errors: one line, no traceback.

Anything the user can fix (bad input, bad paths, unsupported models) raises a
``MoetraceError``; the CLI prints ``error: <message>`` and exits non-zero.
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MoetraceError(Exception):
    """A problem the user can fix, described in one line."""


class InputError(MoetraceError):
    """A prompt line that cannot be used; names file, line and field."""

    def __init__(self, source: str, line: int | None, field: str | None, problem: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        self.problem = problem
        where = source if line is None else f"{source}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")


class ModelError(MoetraceError):
    """A checkpoint that cannot be loaded (missing files, tensors, unsupported config)."""


class CapacityError(MoetraceError):
    """A request that can never fit (context length, KV cache size)."""
