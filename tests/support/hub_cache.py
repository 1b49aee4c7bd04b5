"""A Hugging Face hub cache laid out on disk as huggingface_hub lays it out."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo: str, source: Path, commit: str, ref: str | None) -> Path:
    """One revision in huggingface_hub's layout: files are symlinks into blobs/."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.is_file():
            data = f.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot
