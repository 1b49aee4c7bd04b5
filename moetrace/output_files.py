"""One rule for every file a command writes: traces (record, merge, import), export's file.

An existing file is replaced only with ``--overwrite`` (``record`` may also
continue it with ``--resume``), the words are the same from every command,
and the check runs before any work.  A replaced file is swapped in whole, so
a failed or interrupted write leaves the old file as it was.

And never a file the user needs: ``record demo p.jsonl -o p.jsonl
--overwrite`` replaced the prompt file with the trace (the prompts are read
again after the output exists), and an output that was a device node, FIFO
or socket was replaced by a regular file (as root, ``/dev/null`` became
one).  So only regular files are ever replaced, and an output that is one of
the command's inputs is refused; files are compared by device and inode, so
a hard link or a symbolic link to an input is caught as well as its name.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from moetrace.errors import MoetraceError

STDOUT = "-"
_NOT_FILES = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def check_new_output(path: str | os.PathLike, *, overwrite: bool, resume: bool = False) -> None:
    """Refuse, before any work, an output path the command may not write.

    ``resume``: the command could continue the file instead (``record``), so say so.
    """
    out = Path(path)
    check_replaceable(out)
    if out.exists() and not overwrite:
        also = " or --resume to continue it" if resume else ""
        raise MoetraceError(f"{out} already exists (pass --overwrite to replace it{also})")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise MoetraceError(f"cannot write {out}: no such directory {parent}")
    if not os.access(out if out.exists() else parent, os.W_OK):
        raise MoetraceError(f"cannot write {out}: {_why_not_writable(parent)}")


def _why_not_writable(directory: Path) -> str:
    """A read-only file system said "permission denied" too, which sent users to chmod."""
    with contextlib.suppress(OSError, AttributeError):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only file system"
    return "permission denied"


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path``; renamed over it only when the block succeeds."""
    out = Path(path)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.writing")
    try:
        yield temporary
        check_replaceable(out)  # again: the path may have changed while it was written
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


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuse to replace anything but a regular file (or nothing)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    for test, kind in _NOT_FILES:
        if test(mode):
            raise MoetraceError(
                f"cannot write {path}: it is {kind}, not a regular file "
                "(only regular files are ever replaced)"
            )


def check_not_an_input(
    output: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | int]]
) -> None:
    """Refuse an output that is one of ``inputs``: (what it is, its path or open descriptor)."""
    try:
        st = os.stat(output)
    except (FileNotFoundError, NotADirectoryError):
        return
    target = st.st_dev, st.st_ino
    for what, source in inputs:
        try:
            st = os.fstat(source) if isinstance(source, int) else os.stat(source)
        except (OSError, ValueError):
            continue
        if (st.st_dev, st.st_ino) == target:
            same = "" if _same_name(output, source) else " (the same file under another name)"
            raise MoetraceError(
                f"cannot write {output}: it is {what}{same}; "
                "an output never replaces one of the inputs"
            )


def model_inputs(directory: Path) -> list[tuple[str, Path]]:
    """The files of a checkpoint directory, as inputs an output must not replace."""
    try:
        entries = sorted(p for p in directory.iterdir() if p.is_file())
    except OSError:
        return []
    return [(f"a file of the model ({entry.name})", entry) for entry in entries]


def _same_name(output: str | os.PathLike, source: str | os.PathLike | int) -> bool:
    if isinstance(source, int):
        return False
    return os.path.abspath(output) == os.path.abspath(source)
