"""A MODEL argument resolved once: where its files are, its config, its architecture.

Every command resolves MODEL at its entry (``resolve_model``) and hands the
result down; nothing below reads the argument again.  It is a plain, picklable
value, so tensor-parallel workers and the serving engine process take it as
it is.  MODEL is ``demo``, a checkpoint directory, or a model id of the local
Hugging Face cache (``org/name``, with ``--revision`` or ``@revision``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from moetrace.errors import ModelError, UsageError
from moetrace.models.config_checks import parse_config_file
from moetrace.models.demo import DEMO_NAME, cached_model, model_dir
from moetrace.models.hub_cache import CachedModel
from moetrace.models.registry import resolve_architecture


@dataclass(frozen=True)
class ModelSource:
    name: str  # as handed on to other processes: a cached id carries its @revision
    path: Path  # the checkpoint directory (the packaged one for ``demo``)
    config: dict  # config.json, checked
    architecture: str  # the supported architecture config.json names (its spelling)
    cache: CachedModel | None = None  # the cache entry of a model id
    tokenizer_path: Path | None = None  # a directory with tokenizer.json, if any
    tokenizer_name: str | None = None  # --tokenizer as given (None: the model's own)

    @property
    def is_demo(self) -> bool:
        return self.name == DEMO_NAME

    @property
    def config_digest(self) -> str:
        return config_digest(self.config)

    def provenance(self) -> dict[str, str]:
        """Where the files came from, for the trace: the cache's repository and commit."""
        if self.cache is None:
            return {}
        return {
            "model_repo": self.cache.repo_id,
            "model_revision": self.cache.revision,
            "model_commit": self.cache.commit,
        }

    def context_length(self, max_model_len: int | None = None) -> int:
        """The context a run allows: ``--max-model-len``, refused past the model's (as vLLM
        does)."""
        limit = int(self.config.get("max_position_embeddings", 32768))
        if max_model_len and max_model_len > limit:
            raise UsageError(
                f"--max-model-len {max_model_len}: above the context of {self.name} ({limit} "
                "tokens, max_position_embeddings in its config.json)"
            )
        return max_model_len or limit


def resolve_model(
    model: str,
    revision: str | None = None,
    *,
    tokenizer: str | None = None,
    revision_option: str = "--revision",
) -> ModelSource:
    """MODEL (and ``--revision``, ``--tokenizer``) as a ``ModelSource``; ``ModelError`` if it
    names no supported checkpoint."""
    name = _with_revision(model, revision, revision_option)
    path = model_dir(name)
    config = read_config(path)
    architecture = resolve_architecture(config, str(path))
    return ModelSource(
        name=name,
        path=path,
        config=config,
        architecture=architecture,
        cache=cached_model(name),
        tokenizer_path=_tokenizer_path(path, tokenizer),
        tokenizer_name=tokenizer,
    )


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not path.exists():
        raise ModelError(f"no such model directory: {path}")
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory (MODEL is a checkpoint directory or 'demo')")
    if not config_file.exists():
        raise ModelError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    return parse_config_file(config_file)


def config_digest(config: dict) -> str:
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _with_revision(model: str, revision: str | None, option: str) -> str:
    """MODEL as handed on to every process: a cached model id carries its revision."""
    if revision is None:
        return model
    if model == DEMO_NAME:
        raise ModelError(
            f"{option} {revision}: 'demo' is the built-in model, not a model id from the Hugging "
            "Face cache (only those have revisions)"
        )
    if cached_model(model) is None:
        raise ModelError(
            f"{option} {revision}: {model!r} is a directory, not a model id from the Hugging "
            "Face cache"
        )
    cached_model(f"{model}@{revision}")  # refused now, with the revisions the cache holds
    return f"{model}@{revision}"


def _tokenizer_path(model_path: Path, tokenizer: str | None) -> Path | None:
    """The directory holding the tokenizer: ``--tokenizer``'s (a directory or a model id)
    or the model's own; None when the model has none."""
    if tokenizer is None:
        path = model_path
    else:
        try:
            path = model_dir(tokenizer)
        except ModelError:
            raise ModelError(
                f"--tokenizer {tokenizer}: no such directory, and not a model id in the local "
                "Hugging Face cache"
            ) from None
    if (path / "tokenizer.json").exists():
        return path
    if tokenizer is not None:
        raise ModelError(f"--tokenizer {tokenizer}: no tokenizer.json in {path}")
    return None
