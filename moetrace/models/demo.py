"""The built-in ``demo`` model: a tiny trained Qwen3-MoE shipped inside the package.

``demo`` is only a name for an ordinary checkpoint directory
(``moetrace/assets/demo``), loaded by the same code as any other, so the demo
exercises the real path and its trace can be checked against transformers.
It was trained by ``tools/train_demo.py`` on the Python standard library's
source and docs (docs/demo-model.md), so its experts have specialised and a
trace of it shows structure.  Layer 0 is dense (``mlp_only_layers``): dense
layers get no routing rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from moetrace.models.hub_cache import (
    CachedModel,
    find_cached_model,
    looks_like_repo_id,
    split_revision,
)

DEMO_NAME = "demo"
DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
# The shipped config.json, for callers that need the demo's shape without loading it.
DEMO_CONFIG: dict = json.loads((DEMO_DIR / "config.json").read_text(encoding="utf-8"))


def model_dir(model: str) -> Path:
    """The checkpoint directory a MODEL argument names.

    ``demo`` is the shipped one; an existing path is itself; otherwise a
    Hugging Face model id (``org/name``, ``org/name@revision``) is looked up
    in the local cache (models/hub_cache.py).
    """
    if model == DEMO_NAME:
        return DEMO_DIR
    path = Path(model).expanduser()
    if path.exists():
        return path
    cached = cached_model(model)
    return path if cached is None else cached.path


def cached_model(model: str) -> CachedModel | None:
    """The cache entry a MODEL argument names, or None when it names a directory (or demo).

    Raises ``ModelError`` for a model id that the cache lacks.
    """
    if model == DEMO_NAME or Path(model).expanduser().exists():
        return None
    repo, revision = split_revision(model)
    if not looks_like_repo_id(repo):
        return None
    return find_cached_model(repo, revision)
