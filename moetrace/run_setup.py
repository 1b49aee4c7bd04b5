"""What a ``record`` or ``serve`` run sets up the same way before its engine starts.

The options vLLM refuses with routing capture, the device, the tokenizer, the
context limit, the EOS ids, and the root attributes of the trace the run
writes.  Shared by ``recording`` and ``serving``, which sit side by side and
do not import each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from moetrace import __version__
from moetrace.config import EngineConfig
from moetrace.distributed.sharding import load_model_for_rank
from moetrace.engine.cpu_threads import configure_cpu_threads
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.precompile import start_compile_workers, stop_compile_workers
from moetrace.errors import MoetraceError
from moetrace.models.demo import model_dir
from moetrace.models.loader import LoadedModel
from moetrace.tokenizer import Tokenizer
from moetrace.trace.metadata import TraceMetadata


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


def load_tokenizer(model: str) -> Tokenizer | None:
    path = model_dir(model)
    if not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_dir(path)


def model_context_length(model: str, config: dict, max_model_len: int | None) -> int:
    limit = int(config.get("max_position_embeddings", 32768))
    return min(limit, max_model_len) if max_model_len else limit


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
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        engine_settings=engine_settings,
        moetrace_version=__version__,
        weights_dtype=engine.config.capture_weights,
        logprobs=logprobs,
    )


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
