"""A cheap fingerprint of a checkpoint's weights, so ``--resume`` notices other weights.

The config digest says which architecture and shapes a trace was recorded
with, but a fine-tuned checkpoint has the same config and the same tensor
layout, and its routing differs.  Hashing every byte of a 60 GB checkpoint
would cost minutes at each start, so this reads, per safetensors file, its
name, size and header (tensor names, dtypes, shapes and offsets) and a fixed
set of small blocks spread evenly over the tensor data: some 256 KiB per
file.  Training changes nearly every weight, so another checkpoint of the
same layout differs in the sampled blocks too.  A change confined to the
bytes between samples (one hand-edited tensor) can pass unnoticed;
docs/reliability.md says so.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from moetrace.models.checkpoint_files import safetensors_files

SAMPLES_PER_FILE = 64
SAMPLE_BYTES = 4096


def weights_digest(checkpoint: Path, load_format: str) -> str:
    """``sampled-sha256:<hex>`` for safetensors weights; ``dummy`` for random ones."""
    if load_format == "dummy":
        return "dummy"  # random weights: the run seed, compared on its own, decides them
    digest = hashlib.sha256()
    for path in safetensors_files(checkpoint):
        _add_file(digest, path)
    return f"sampled-sha256:{digest.hexdigest()}"


def _add_file(digest: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        prefix = f.read(8)
        digest.update(prefix)
        if len(prefix) < 8:
            return
        (header_len,) = struct.unpack("<Q", prefix)
        header_len = min(header_len, size - 8)
        digest.update(f.read(header_len))
        data_start = 8 + header_len
        data_len = size - data_start
        if data_len <= 0:
            return
        if data_len <= SAMPLES_PER_FILE * SAMPLE_BYTES:
            digest.update(f.read())
            return
        step = (data_len - SAMPLE_BYTES) / (SAMPLES_PER_FILE - 1)
        for i in range(SAMPLES_PER_FILE):
            f.seek(data_start + int(i * step))
            digest.update(f.read(SAMPLE_BYTES))
