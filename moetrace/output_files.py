"""One rule for every file a command writes: record's trace, export's file, merge's trace.

An existing file is replaced only with ``--overwrite`` (``record`` may also
continue it with ``--resume``), the words are the same from every command,
and the check runs before any work.  A replaced file is swapped in whole, so
a failed or interrupted write leaves the old file as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from moetrace.errors import MoetraceError

STDOUT = "-"


def check_new_output(path: str | os.PathLike, *, overwrite: bool, resume: bool = False) -> None:
    """Refuse, before any work, an output path the command may not write.

    ``resume``: the command could continue the file instead (``record``), so say so.
    """
    out = Path(path)
    if out.is_dir():
        raise MoetraceError(f"cannot write {out}: it is a directory")
    if out.exists() and not overwrite:
        also = " or --resume to continue it" if resume else ""
        raise MoetraceError(f"{out} already exists (pass --overwrite to replace it{also})")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise MoetraceError(f"cannot write {out}: no such directory {parent}")
    if not os.access(out if out.exists() else parent, os.W_OK):
        raise MoetraceError(f"cannot write {out}: permission denied")


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path``; renamed over it only when the block succeeds."""
    out = Path(path)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.writing")
    try:
        yield temporary
        os.replace(temporary, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def refuse_binary_terminal(fmt: str, stream) -> None:
    """Binary output on a terminal is noise at best: ask for a redirect or a file."""
    if stream.isatty():
        raise MoetraceError(
            f"--format {fmt} is binary: redirect standard output to a file, or give -o FILE"
        )
