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
from pathlib import Path

import h5py
import numpy as np

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
    """The stored files by name; empty for a trace written before they were stored."""
    group = f.get(GROUP)
    if not isinstance(group, h5py.Group):
        return {}
    return {name: ds[()].tobytes() for name, ds in group.items() if isinstance(ds, h5py.Dataset)}


def problems(f: h5py.File) -> list[str]:
    """Stored files whose bytes no longer match their CRC-32 (one line each)."""
    found = []
    group = f.get(GROUP)
    if not isinstance(group, h5py.Group):
        return found
    for name, ds in group.items():
        try:
            data = ds[()].tobytes()
        except OSError as exc:
            found.append(f"tokenizer file {name!r} unreadable: {exc}")
            continue
        if "crc32" in ds.attrs and zlib.crc32(data) != int(ds.attrs["crc32"]):
            found.append(f"tokenizer file {name!r}: checksum mismatch")
    return found
