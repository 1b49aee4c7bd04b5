"""User-facing errors: one line, no traceback.

Anything the user can fix (bad input, bad paths, unsupported models) raises a
``MoetraceError``; the CLI prints ``error: <message>`` and exits non-zero.
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` with its control characters (a newline in a JSON key the user wrote, say)
    shown as escapes, so that a message quoting the user's input stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def install_extra(extra: str) -> str:
    """How to add an optional extra: moetrace is installed from its clone, not an index."""
    return f"in moetrace's clone: make extra EXTRA={extra} (or pip install -e '.[{extra}]')"


class MoetraceError(Exception):
    """A problem the user can fix, described in one line."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (one_line(args[0]),)
        super().__init__(*args)


class UsageError(MoetraceError):
    """An option value the command cannot take, found where only the model or the trace
    tells (``--max-model-len`` past the context, ``--token`` past the vocabulary): one
    line and exit 2, as click's usage errors."""


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
