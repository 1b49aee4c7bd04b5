"""Model ids (``Qwen/Qwen3-30B-A3B``) found in the local Hugging Face cache, without a network.

The cache is huggingface_hub's layout: under ``$HF_HUB_CACHE`` (else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) a repository lives in
``models--<org>--<name>``, its files in ``snapshots/<commit>/`` and each
branch or tag in ``refs/<name>``, a file holding the commit.  A revision is a
branch or tag name (``main`` by default) or a full commit hash.  Whatever
``hf download`` or ``transformers`` put there is found; nothing is fetched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from moetrace.errors import ModelError

DEFAULT_REVISION = "main"
# huggingface_hub's repo id rule: [org/]name of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repositories."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache.expanduser() / "huggingface" / "hub"


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` or ``name`` as the Hub spells ids (no '..' or '--', at most one '/')."""
    return (
        bool(_REPO_ID.match(name))
        and ".." not in name
        and "--" not in name
        and not name.startswith((".", "-"))
        and len(name) <= 96
    )


@dataclass(frozen=True)
class CachedModel:
    """A repository revision found in the cache."""

    repo_id: str
    revision: str
    commit: str
    path: Path  # the snapshot directory


def split_revision(model: str) -> tuple[str, str | None]:
    """``repo@revision`` (how moetrace hands a model on with its --revision) apart."""
    if "@" in model:
        repo, revision = model.rsplit("@", 1)
        return repo, revision or None
    return model, None


def find_cached_model(repo_id: str, revision: str | None = None) -> CachedModel:
    """The snapshot of ``repo_id`` at ``revision`` in the local cache; ``ModelError`` if absent."""
    revision = revision or DEFAULT_REVISION
    cache = hub_cache_dir()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo.is_dir():
        raise ModelError(
            f"model {repo_id!r}: no such directory, and not in the Hugging Face cache {cache} "
            f"(moetrace never downloads: fetch it first, e.g. 'hf download {repo_id}', or give "
            "a checkpoint directory)"
        )
    if _COMMIT.match(revision):
        commit = revision
    else:
        ref = repo / "refs" / revision
        if not ref.is_file() or not ref.resolve().is_relative_to((repo / "refs").resolve()):
            raise ModelError(
                f"model {repo_id!r}: revision {revision!r} is not in the Hugging Face cache "
                f"({_cached_revisions(repo)})"
            )
        commit = ref.read_text(encoding="utf-8").strip()
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelError(
            f"model {repo_id!r}: revision {revision!r} (commit {commit[:12]}) has no snapshot in "
            f"the Hugging Face cache ({_cached_revisions(repo)})"
        )
    return CachedModel(repo_id, revision, commit, snapshot)


def _cached_revisions(repo: Path) -> str:
    refs = repo / "refs"
    names = (
        sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file())
        if refs.is_dir()
        else []
    )
    snapshots = (
        sorted(p.name[:12] for p in (repo / "snapshots").glob("*"))
        if (repo / "snapshots").is_dir()
        else []
    )
    have = ", ".join(names) or "no branches"
    return f"cached: {have}; snapshots {', '.join(snapshots) or 'none'}"
