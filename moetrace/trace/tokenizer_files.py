"""A trace carries its tokenizer's files, so its token ids read as text on any machine.

The root attribute ``tokenizer`` names where the tokenizer was when the trace
was written: a path that means nothing once the trace is copied elsewhere.
So the files that turn ids into text (``tokenizer.json``) and prompts into
ids (its config and chat template) are stored in the group ``tokenizer``,
one gzip-compressed uint8 dataset per file under its own name, each with the
CRC-32 of its bytes (docs/trace-format.md).  Plain h5py reads them back:
``bytes(f["tokenizer/tokenizer.json"][()])``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from moetrace.errors import MoetraceError

GROUP = "tokenizer"
# What decodes ids (tokenizer.json) and what encoded the prompts (its config, chat template).
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def collect(directory: str | Path) -> dict[str, bytes]:
    """The tokenizer files present in a checkpoint directory, by name."""
    root = Path(directory)
    return {name: (root / name).read_bytes() for name in FILES if (root / name).is_file()}


def write(f: h5py.File, files: dict[str, bytes]) -> None:
    """Store ``files`` in the trace (nothing when there are none)."""
    if not files:
        return
    group = f.require_group(GROUP)
    for name, data in files.items():
        array = np.frombuffer(data, dtype=np.uint8)
        packed = {"compression": "gzip", "compression_opts": 6} if len(array) else {}
        ds = group.create_dataset(name, data=array, **packed)
        ds.attrs["crc32"] = zlib.crc32(data)


def read(f: h5py.File) -> dict[str, bytes]:
    """The stored files by name; empty for a trace written before they were stored.

    A file HDF5 cannot read back (a damaged chunk or link) is one line, naming it.
    """
    try:
        return {name: ds[()].tobytes() for name, ds in _members(f)}
    except _DAMAGE as exc:
        raise MoetraceError(
            f"{f.filename}: its tokenizer files cannot be read, the trace is damaged "
            f"({_one_line(exc)}); 'moetrace verify' says more"
        ) from None


def problems(f: h5py.File) -> list[str]:
    """Stored files that do not read back or no longer match their CRC-32 (one line each)."""
    found = []
    try:
        members = list(_members(f))
    except _DAMAGE as exc:
        return [f"tokenizer group unreadable: {_one_line(exc)}"]
    for name, ds in members:
        try:
            data = ds[()].tobytes()
            crc = int(ds.attrs["crc32"]) if "crc32" in ds.attrs else None
        except _DAMAGE as exc:
            found.append(f"tokenizer file {name!r} unreadable: {_one_line(exc)}")
            continue
        if crc is not None and zlib.crc32(data) != crc:
            found.append(f"tokenizer file {name!r}: checksum mismatch")
    return found


# What h5py raises on a damaged group, link or chunk (a dangling link reads as None).
_DAMAGE = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError)


def _members(f: h5py.File) -> Iterator[tuple[str, h5py.Dataset]]:
    group = f.get(GROUP)
    if group is None:
        return
    if not isinstance(group, h5py.Group):
        raise TypeError(f"{GROUP!r} is not a group")
    for name in group:
        ds = group.get(name)
        if not isinstance(ds, h5py.Dataset):
            raise TypeError(f"tokenizer member {name!r} is not a dataset")
        yield name, ds


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
