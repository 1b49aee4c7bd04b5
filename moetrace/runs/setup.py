"""What a ``record`` or ``serve`` run sets up the same way before its engine starts.

The options vLLM refuses with routing capture, the device, the tokenizer, the
context limit, the EOS ids, and the root attributes of the trace the run
writes.  Shared by ``recording`` and ``serving``, which sit side by side and
do not import each other.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from moetrace import __version__
from moetrace.config import EngineConfig
from moetrace.distributed.sharding import load_model_for_rank
from moetrace.engine.cpu_threads import configure_cpu_threads
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.precompile import start_compile_workers, stop_compile_workers
from moetrace.engine.sampling import sampling_problem
from moetrace.errors import ModelError, MoetraceError, UsageError
from moetrace.inputs.tokenizer import Tokenizer
from moetrace.models.demo import DEMO_NAME, cached_model, model_dir
from moetrace.models.loader import LoadedModel
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.tokenizer_files import collect as collect_tokenizer_files


def check_supported(*, pipeline_parallel_size: int = 1, cpu_offload_gb: float = 0.0) -> None:
    """Refuse, at start, vLLM options that routing capture cannot honour.

    vLLM refuses both with routed-experts capture: with pipeline parallelism no
    single worker sees every MoE layer's routing for a token, and offloaded
    weights run outside the layers that capture.  Every layer stays on every
    device (one, or a tensor-parallel group).
    """
    if pipeline_parallel_size < 1:
        raise MoetraceError(
            f"--pipeline-parallel-size must be at least 1, got {pipeline_parallel_size}"
        )
    if pipeline_parallel_size > 1:
        raise MoetraceError(
            f"--pipeline-parallel-size {pipeline_parallel_size}: routing capture does not support "
            "pipeline parallelism (vLLM refuses it too); split a model too big for one device "
            "with --tensor-parallel-size"
        )
    if cpu_offload_gb < 0:
        raise MoetraceError(f"--cpu-offload-gb must be >= 0, got {cpu_offload_gb}")
    if cpu_offload_gb > 0:
        raise MoetraceError(
            f"--cpu-offload-gb {cpu_offload_gb:g}: routing capture does not support CPU weight "
            "offload (vLLM refuses it too); use --device cpu to run entirely on the CPU"
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MoetraceError("--device cuda asked for, but torch sees no CUDA device")
    if name not in ("cuda", "cpu"):
        raise MoetraceError(f"unknown device {name!r}; choose auto, cuda or cpu")
    return torch.device(name)


def load_tokenizer(model: str, tokenizer: str | None = None) -> Tokenizer | None:
    """The model's tokenizer, or the one ``--tokenizer`` names (a directory or a model id)."""
    try:
        path = model_dir(tokenizer or model)
    except ModelError as exc:  # named as the option, not as a model
        if tokenizer is None:
            raise
        problem = str(exc).removeprefix(f"model {tokenizer!r}: ")
        raise MoetraceError(f"--tokenizer {tokenizer}: {problem}") from None
    if not (path / "tokenizer.json").exists():
        if tokenizer is not None:
            raise MoetraceError(f"--tokenizer {tokenizer}: no tokenizer.json in {path}")
        return None
    return Tokenizer.from_dir(path)


def model_with_revision(model: str, revision: str | None, option: str = "--revision") -> str:
    """MODEL as handed on to every process: a cached model id carries its revision."""
    if revision is None:
        return model
    if cached_model(model) is None:
        what = "'demo' is the built-in model" if model == DEMO_NAME else f"{model!r} is a directory"
        raise MoetraceError(
            f"{option} {revision}: {what}, not a model id from the Hugging Face cache (only "
            "those have revisions)"
        )
    cached_model(f"{model}@{revision}")  # refused now, with the revisions the cache holds
    return f"{model}@{revision}"


def refuse_remote_code(trust_remote_code: bool) -> None:
    """vLLM's --trust-remote-code runs Python shipped with a checkpoint; moetrace never does."""
    if trust_remote_code:
        raise MoetraceError(
            "--trust-remote-code: moetrace never runs code shipped with a checkpoint; it has its "
            "own implementation of each supported architecture (moetrace record --help lists "
            "them), so leave the option out"
        )


def model_source(model: str) -> dict:
    """Where MODEL's files came from, for the trace: the cache's repository and commit."""
    cached = cached_model(model)
    if cached is None:
        return {}
    return {"model_repo": cached.repo_id, "model_revision": cached.revision,
            "model_commit": cached.commit}  # fmt: skip


# generation_config.json keys vLLM's --generation-config takes as defaults, by SamplingParams name.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model: str, mode: str) -> tuple[dict[str, Any], str | None]:
    """vLLM's ``--generation-config``: (sampling defaults, the file they came from).

    ``auto`` reads the checkpoint's generation_config.json, ``vllm`` none, any
    other value is a directory holding one.  As vLLM (with transformers 5)
    does, every sampling key the file sets counts; ``max_new_tokens`` is
    ``max_tokens``.  Values are checked against the rules a prompt line obeys.
    """
    if mode == "vllm":
        return {}, None
    directory = model_dir(model) if mode == "auto" else Path(mode).expanduser()
    if mode != "auto" and not directory.is_dir():
        raise MoetraceError(f"--generation-config {mode}: not auto, vllm or a directory")
    path = directory / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise MoetraceError(f"--generation-config {mode}: no generation_config.json in it")
        return {}, None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read ({exc})".splitlines()[0]) from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: expected a JSON object")
    defaults = {}
    for key, name in GENERATION_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        problem = sampling_problem(name, value)
        if problem is not None:
            raise ModelError(f"{path}: '{key}': {problem}, got {value!r}")
        defaults[name] = max(value, 0) if name == "top_k" else value
    return defaults, str(path)


def model_context_length(model: str, config: dict, max_model_len: int | None) -> int:
    """The context a run allows: ``--max-model-len``, refused past the model's (as vLLM does)."""
    limit = int(config.get("max_position_embeddings", 32768))
    if max_model_len and max_model_len > limit:
        raise UsageError(
            f"--max-model-len {max_model_len}: above the context of {model} ({limit} tokens, "
            "max_position_embeddings in its config.json)"
        )
    return max_model_len or limit


def eos_token_ids(tokenizer: Tokenizer | None, config: dict) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer's, else config.json's ``eos_token_id``."""
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
    if not eos and config.get("eos_token_id") is not None:
        value = config["eos_token_id"]
        eos = tuple(value) if isinstance(value, list) else (int(value),)
    return eos


def model_metadata(
    model_name: str,
    engine: LLMEngine,
    architecture: str,
    digest: str,
    tokenizer: Tokenizer | None,
    engine_settings: dict,
    *,
    logprobs: bool = False,
) -> TraceMetadata:
    """The root attributes of a trace of ``engine``'s model (``record`` and ``serve``).

    Gate weights are written when the engine captures them; ``logprobs``: every
    request asks for its tokens' log-probabilities, and the trace keeps them.
    """
    model = engine.model
    return TraceMetadata(
        model=model_name,
        architecture=architecture,
        config_digest=digest,
        num_hidden_layers=len(getattr(model, "layers", [])),
        moe_layer_indices=list(model.moe_layer_indices),
        num_experts=model.num_experts,
        top_k=model.top_k,
        vocab_size=model.vocab_size,
        tokenizer=None if tokenizer is None else tokenizer.path,
        tokenizer_files=_tokenizer_files(tokenizer),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        engine_settings=engine_settings,
        moetrace_version=__version__,
        weights_dtype=engine.config.capture_weights,
        logprobs=logprobs,
    )


def _tokenizer_files(tokenizer: Tokenizer | None) -> dict[str, bytes]:
    """The files the trace carries so that its ids read as text anywhere."""
    directory = getattr(tokenizer, "directory", None)
    return collect_tokenizer_files(directory) if directory is not None else {}


class RunSpec(Protocol):
    """What ``load_engine`` reads of a ``Recording`` or a ``Server``."""

    model_name: str
    device: torch.device
    dtype: str
    load_format: str
    engine_config: EngineConfig
    tokenizer: Tokenizer | None


@dataclass
class ReadyEngine:
    loaded: LoadedModel
    engine: LLMEngine
    eos_token_ids: tuple[int, ...]
    weights_s: float  # seconds to load the weights


def load_engine(run: RunSpec) -> ReadyEngine:
    """The weights and an engine over them, this rank's share under tensor parallelism."""
    device, config, tokenizer = run.device, run.engine_config, run.tokenizer
    clock = time.perf_counter()
    if device.type == "cuda" and config.use_kernels:
        start_compile_workers()  # forked before the weights load; compile while they do
    try:
        loaded = load_model_for_rank(
            run.model_name,
            device=device,
            dtype=run.dtype,
            load_format=run.load_format,
            seed=config.seed,
        )
        weights_s = time.perf_counter() - clock
        eos = eos_token_ids(tokenizer, loaded.config)
        configure_cpu_threads(loaded.model, device)
        # The tokenizer lets the engine match stop strings on the detokenized output.
        engine = LLMEngine(loaded.model, config, device, eos_token_ids=eos, tokenizer=tokenizer)
    finally:
        stop_compile_workers()
    return ReadyEngine(loaded, engine, eos, weights_s)
