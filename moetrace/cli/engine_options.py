"""The options of the model and its engine, declared once for ``record``, ``serve`` and ``replay``.

``ENGINE_OPTIONS`` lists each option once (vLLM's names).  A command asks for
them with a parameter ``engine: EngineArgs`` and the ``with_engine_options``
decorator: typer sees the options in that parameter's place, and the command
receives them as one ``EngineArgs``, which resolves the model once and builds
the run's ``RunOptions``.  So the flags, defaults and help cannot drift
between commands, and no command writes the list out again.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from moetrace.config import EngineConfig
from moetrace.errors import MoetraceError
from moetrace.models.registry import supported_architectures

if TYPE_CHECKING:  # torch loads only when a run starts
    from moetrace.distributed.state import ParallelConfig
    from moetrace.runs.setup import RunOptions

SUPPORTED = ", ".join(supported_architectures())
PANEL = "Model and engine"

MODEL = typer.Argument(
    ...,
    metavar="MODEL",
    help="Checkpoint directory (config.json + safetensors), a model id in the local Hugging "
    f"Face cache (Qwen/Qwen3-30B-A3B; never downloaded) or 'demo'. Supported: {SUPPORTED}.",
)
GENERATION_CONFIG = typer.Option(
    "auto",
    "--generation-config",
    help="Sampling defaults: auto (the model's generation_config.json), vllm (none) or a "
    "directory holding a generation_config.json.",
)
RECORD_WEIGHTS = typer.Option(
    False,
    "--record-weights",
    help="Also capture each chosen expert's gate weight (what the model multiplies its output "
    "by), beside the ids.",
)
FLUSH_INTERVAL = typer.Option(
    5.0, "--flush-interval", help="Seconds between flushes: the most a crash can lose."
)
FLUSH_EVERY = typer.Option(64, "--flush-every", help="Finished requests between flushes.")


class WeightsDtype(str, enum.Enum):
    """How gate weights are stored (trace-format.md, ``routed_weights``)."""

    float16 = "float16"
    float32 = "float32"


def _option(default: Any, *names: str, help: str | None = None) -> typer.models.OptionInfo:
    return typer.Option(default, *names, help=help, rich_help_panel=PANEL)


# name -> (type, option): the parameters ``with_engine_options`` puts in a command.
ENGINE_OPTIONS: dict[str, tuple[Any, typer.models.OptionInfo]] = {
    "revision": (
        str | None,
        _option(
            None, "--revision", help="Branch, tag or commit of a cached model id (default: main)."
        ),
    ),
    "tokenizer": (
        str | None,
        _option(
            None,
            "--tokenizer",
            help="Tokenizer directory or cached model id (default: the model's).",
        ),
    ),
    "trust_remote_code": (
        bool,
        _option(
            False,
            "--trust-remote-code",
            help="Refused: moetrace never runs a checkpoint's own code (it has its own models).",
        ),
    ),
    "seed": (
        int,
        _option(0, "--seed", help="Run seed; a request without its own seed samples from this."),
    ),
    "dtype": (
        str,
        _option(
            "auto",
            "--dtype",
            help="auto, bfloat16, float16, float32, float64 (auto: the checkpoint's on CUDA, "
            "float32 on CPU).",
        ),
    ),
    "device": (str, _option("auto", "--device", help="auto, cuda or cpu.")),
    "load_format": (
        str,
        _option(
            "auto", "--load-format", help="auto, safetensors or dummy (seeded random weights)."
        ),
    ),
    "block_size": (int, _option(16, "--block-size", help="Tokens per KV cache block.")),
    "num_kv_blocks": (
        int | None,
        _option(
            None,
            "--num-kv-blocks",
            help="KV cache capacity in blocks (default: sized from memory).",
        ),
    ),
    "max_num_seqs": (int, _option(256, "--max-num-seqs", help="Most sequences in one step.")),
    "max_num_batched_tokens": (
        int,
        _option(
            8192,
            "--max-num-batched-tokens",
            help="Most tokens in one step (longer prompts are chunked).",
        ),
    ),
    "max_model_len": (
        int | None,
        _option(None, "--max-model-len", help="Context limit (default: the model's)."),
    ),
    "enable_prefix_caching": (
        bool,
        _option(True, "--enable-prefix-caching/--no-enable-prefix-caching"),
    ),
    "gpu_memory_utilization": (
        float,
        _option(
            0.9,
            "--gpu-memory-utilization",
            help="Share of GPU memory for weights, activations and KV cache.",
        ),
    ),
    "pipeline_parallel_size": (
        int,
        _option(
            1,
            "--pipeline-parallel-size",
            help="Only 1: routing capture needs every MoE layer in one pipeline stage.",
        ),
    ),
    "cpu_offload_gb": (
        float,
        _option(
            0.0, "--cpu-offload-gb", help="Only 0: routing capture does not support weight offload."
        ),
    ),
    "enforce_eager": (
        bool,
        _option(
            False,
            "--enforce-eager",
            help="No CUDA graphs: every step runs eagerly (slower, same trace). "
            "Tensor parallel runs eagerly already.",
        ),
    ),
    "max_cudagraph_capture_size": (
        int,
        _option(
            2048,
            "--max-cudagraph-capture-size",
            help="Steps of up to this many tokens (padded) replay CUDA graphs; larger ones run "
            "eagerly at padded sizes.",
        ),
    ),
    "tensor_parallel_size": (
        int | None,
        _option(
            None,
            "--tensor-parallel-size",
            "-tp",
            help="Devices to split the model over, one process each (default: 1, or torchrun's "
            "process count). See docs/distributed.md.",
        ),
    ),
    "enable_expert_parallel": (
        bool,
        _option(
            False,
            "--enable-expert-parallel",
            help="With tensor parallelism: whole experts per rank instead of a slice of each.",
        ),
    ),
    "sequence_parallel_moe": (
        bool,
        _option(
            False,
            "--sequence-parallel-moe",
            help="With tensor parallelism: each rank routes a slice of the tokens; capture gathers.",
        ),
    ),
    "weights_dtype": (
        WeightsDtype,
        _option(
            WeightsDtype.float16,
            "--weights-dtype",
            help="How gate weights are kept (and sent): float16 or float32.",
        ),
    ),
}


@dataclass(frozen=True)
class EngineArgs:
    """The options of ``ENGINE_OPTIONS`` as the command line gave them."""

    revision: str | None
    tokenizer: str | None
    trust_remote_code: bool
    seed: int
    dtype: str
    device: str
    load_format: str
    block_size: int
    num_kv_blocks: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    pipeline_parallel_size: int
    cpu_offload_gb: float
    enforce_eager: bool
    max_cudagraph_capture_size: int
    tensor_parallel_size: int | None
    enable_expert_parallel: bool
    sequence_parallel_moe: bool
    weights_dtype: WeightsDtype

    def check(self) -> None:
        """The refusals that need no model: vLLM options routing capture cannot honour."""
        check_supported(
            pipeline_parallel_size=self.pipeline_parallel_size, cpu_offload_gb=self.cpu_offload_gb
        )
        refuse_remote_code(self.trust_remote_code)

    def parallel(self) -> ParallelConfig | None:
        """The checked tensor-parallel options; None in a torchrun worker (rank > 0), which
        has then run rank 0's steps to the end and has nothing left to do (it takes the
        model rank 0 resolved)."""
        from moetrace.engine.launch import is_torchrun_worker, prepare_parallel, run_torchrun_worker

        parallel = prepare_parallel(
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            sequence_parallel_moe=self.sequence_parallel_moe,
            device=self.device,
            dtype=self.dtype,
        )
        if is_torchrun_worker(parallel):
            run_torchrun_worker(parallel, self.device)
            return None
        return parallel

    def run_options(
        self, model: str, parallel: ParallelConfig, *, capture_weights: bool
    ) -> RunOptions:
        """How the run starts its engine, MODEL (with ``--revision`` and ``--tokenizer``)
        resolved once for the whole run; tensor parallel runs eagerly (docs/distributed.md)."""
        from moetrace.runs.setup import RunOptions

        engine = EngineConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            seed=self.seed,
            enforce_eager=self.enforce_eager or parallel.enabled,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size,
            capture_weights=self.weights_dtype.value if capture_weights else None,
        )
        return RunOptions.resolve(
            model,
            self.revision,
            tokenizer=self.tokenizer,
            parallel=parallel,
            engine=engine,
            device=self.device,
            dtype=self.dtype,
            load_format=self.load_format,
        )


def with_options(
    param: str, table: dict[str, tuple[Any, Any]], group: type
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that puts ``table``'s options where a command has its ``param: group``
    parameter, and calls the command with them gathered into one ``group``."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        parameters = []
        for p in signature.parameters.values():
            if p.name != param:
                parameters.append(p)
                continue
            parameters += [
                inspect.Parameter(name, p.kind, default=option, annotation=kind)
                for name, (kind, option) in table.items()
            ]

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in table}
            return command(*args, **{param: group(**given)}, **kwargs)

        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        # typer reads this signature and these (evaluated) annotations, not the command's own.
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        del run.__wrapped__
        return run

    return decorate


# Put ``ENGINE_OPTIONS`` where a command has its ``engine: EngineArgs`` parameter.
with_engine_options = with_options("engine", ENGINE_OPTIONS, EngineArgs)


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


def refuse_remote_code(trust_remote_code: bool) -> None:
    """vLLM's --trust-remote-code runs Python shipped with a checkpoint; moetrace never does."""
    if trust_remote_code:
        raise MoetraceError(
            "--trust-remote-code: moetrace never runs code shipped with a checkpoint; it has its "
            "own implementation of each supported architecture (moetrace record --help lists "
            "them), so leave the option out"
        )


assert {f.name for f in dataclasses.fields(EngineArgs)} == set(ENGINE_OPTIONS)
