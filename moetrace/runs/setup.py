"""What ``record``, ``serve`` and ``replay`` set up the same way before their engine starts.

The run's options (``RunOptions``), the device, the tokenizer, the sampling
defaults of the checkpoint, the EOS ids, the engine over the loaded weights,
and the root attributes of the trace the run writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from moetrace import __version__
from moetrace.config import EngineConfig
from moetrace.distributed.guards import check_model_shardable
from moetrace.distributed.sharding import load_model_for_rank
from moetrace.distributed.state import ParallelConfig
from moetrace.engine.cpu_threads import configure_cpu_threads
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.precompile import start_compile_workers, stop_compile_workers
from moetrace.engine.sampling import sampling_problem
from moetrace.errors import ModelError, MoetraceError
from moetrace.inputs.tokenizer import Tokenizer
from moetrace.models.loader import LoadedModel
from moetrace.models.source import ModelSource, resolve_model
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.tokenizer_files import collect as collect_tokenizer_files


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MoetraceError("--device cuda asked for, but torch sees no CUDA device")
    if name not in ("cuda", "cpu"):
        raise MoetraceError(f"unknown device {name!r}; choose auto, cuda or cpu")
    return torch.device(name)


def load_tokenizer(model: ModelSource) -> Tokenizer | None:
    """The tokenizer ``model`` resolved (its own, or ``--tokenizer``'s); None if it has none."""
    return None if model.tokenizer_path is None else Tokenizer.from_dir(model.tokenizer_path)


@dataclass(frozen=True)
class RunOptions:
    """How a run starts its engine: which model, where, in what dtype, with which settings.

    Built once by the command (``record``, ``serve``, ``replay``) from its
    options and handed to the run; Python callers build it with ``of``.
    """

    model: ModelSource
    engine: EngineConfig = field(default_factory=EngineConfig)
    device: str = "auto"  # auto, cuda or cpu (resolved by the run)
    dtype: str = "auto"
    load_format: str = "auto"
    # Recorded beside the engine's settings, not compared on --resume (tensor parallelism).
    extra_settings: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: str | ModelSource, **options: Any) -> RunOptions:
        source = resolve_model(model) if isinstance(model, str) else model
        return cls(source, **options)

    @classmethod
    def resolve(
        cls,
        model: str,
        revision: str | None,
        *,
        tokenizer: str | None,
        parallel: ParallelConfig,
        **options: Any,
    ) -> RunOptions:
        """A command's run: MODEL resolved, and held against the tensor-parallel group."""
        source = resolve_model(model, revision, tokenizer=tokenizer)
        if parallel.enabled:
            check_model_shardable(source.config, parallel)
        return cls(source, extra_settings=parallel.to_dict(), **options)


# generation_config.json keys vLLM's --generation-config takes as defaults, by SamplingParams name.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model: ModelSource, mode: str) -> tuple[dict[str, Any], str | None]:
    """vLLM's ``--generation-config``: (sampling defaults, the file they came from).

    ``auto`` reads the checkpoint's generation_config.json, ``vllm`` none, any
    other value is a directory holding one.  As vLLM (with transformers 5)
    does, every sampling key the file sets counts; ``max_new_tokens`` is
    ``max_tokens``.  Values are checked against the rules a prompt line obeys.
    """
    if mode == "vllm":
        return {}, None
    directory = model.path if mode == "auto" else Path(mode).expanduser()
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


def eos_token_ids(tokenizer: Tokenizer | None, config: dict) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer's, else config.json's ``eos_token_id``."""
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
    if not eos and config.get("eos_token_id") is not None:
        value = config["eos_token_id"]
        eos = tuple(value) if isinstance(value, list) else (int(value),)
    return eos


def model_metadata(
    source: ModelSource,
    engine: LLMEngine,
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
        model=source.name,
        architecture=engine.model.architecture,
        config_digest=source.config_digest,
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
    """What ``load_engine`` reads of a ``Recording``, a ``Replay`` or a ``Server``."""

    model: ModelSource
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
            run.model,
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
