"""A checkpoint's safetensors files, found and opened so that a bad one costs one line.

The safetensors library refuses lying headers, truncated files and the like
with its own exception; let through, it printed a traceback.  And
``model.safetensors.index.json`` is data from a download: an entry naming
``../../../../etc/passwd`` was opened as weights.  So the index is parsed
defensively and each file it names must lie inside the model directory by
name: no absolute path, no ``..``.  Symbolic links are followed as they are
(the Hugging Face cache links each file to a blob outside the snapshot).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from safetensors import SafetensorError, safe_open

from moetrace.errors import ModelError

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the index names, else every ``*.safetensors``."""
    index = path / INDEX_NAME
    if index.exists():
        files = sorted({path / name for name in _index_entries(index)})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelError(f"{index}: names missing shard files: {', '.join(missing[:3])}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{path}: no *.safetensors files (use --load-format dummy for random weights)"
        )
    return files


def _index_entries(index: Path) -> set[str]:
    try:
        with index.open("rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
        if len(raw) > MAX_INDEX_BYTES:
            raise ModelError(f"{index}: larger than {MAX_INDEX_BYTES >> 20} MiB, not an index")
        data = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ModelError(f"{index}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ModelError(f"{index}: not UTF-8 text") from None
    except RecursionError:
        raise ModelError(f"{index}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise ModelError(f"{index}: not valid JSON ({exc})".splitlines()[0]) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelError(f"{index}: expected an object with a 'weight_map' object")
    names = set()
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ModelError(f"{index}: tensor {tensor!r} maps to {name!r}, not a file name")
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise ModelError(
                f"{index}: tensor {tensor!r} names {name!r}, outside the model directory"
            )
        names.add(name)
    return names


@contextmanager
def open_safetensors(file: Path, device: str = "cpu") -> Iterator:
    """``safe_open`` whose refusals (and read errors while open) are one-line ``ModelError``s."""
    try:
        handle = safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelError(f"{file}: not a readable safetensors file ({_cause(exc)})") from None
    with handle as f:
        try:
            yield f
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"{file}: cannot read its tensors ({_cause(exc)})") from None


def _cause(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
