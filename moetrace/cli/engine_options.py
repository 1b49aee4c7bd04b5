"""Engine options that ``record`` and ``serve`` share, declared once (vLLM's names).

Each constant is a typer option used as a parameter default in both
commands, so the flags, defaults and help texts cannot drift apart.
"""

from __future__ import annotations

import enum

import typer

from moetrace.config import EngineConfig
from moetrace.models.registry import supported_architectures

SUPPORTED = ", ".join(supported_architectures())

MODEL = typer.Argument(
    ...,
    metavar="MODEL",
    help="Checkpoint directory (config.json + safetensors), a model id in the local Hugging "
    f"Face cache (Qwen/Qwen3-30B-A3B; never downloaded) or 'demo'. Supported: {SUPPORTED}.",
)
REVISION = typer.Option(
    None, "--revision", help="Branch, tag or commit of a cached model id (default: main)."
)
TOKENIZER = typer.Option(
    None, "--tokenizer", help="Tokenizer directory or cached model id (default: the model's)."
)
TRUST_REMOTE_CODE = typer.Option(
    False,
    "--trust-remote-code",
    help="Refused: moetrace never runs a checkpoint's own code (it has its own models).",
)
GENERATION_CONFIG = typer.Option(
    "auto",
    "--generation-config",
    help="Sampling defaults: auto (the model's generation_config.json), vllm (none) or a "
    "directory holding a generation_config.json.",
)
SEED = typer.Option(0, "--seed", help="Run seed; a request without its own seed samples from this.")
DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="auto, bfloat16, float16, float32, float64 (auto: the checkpoint's on CUDA, float32 on CPU).",
)
DEVICE = typer.Option("auto", "--device", help="auto, cuda or cpu.")
LOAD_FORMAT = typer.Option(
    "auto", "--load-format", help="auto, safetensors or dummy (seeded random weights)."
)
BLOCK_SIZE = typer.Option(16, "--block-size", help="Tokens per KV cache block.")
NUM_KV_BLOCKS = typer.Option(
    None, "--num-kv-blocks", help="KV cache capacity in blocks (default: sized from memory)."
)
MAX_NUM_SEQS = typer.Option(256, "--max-num-seqs", help="Most sequences in one step.")
MAX_NUM_BATCHED_TOKENS = typer.Option(
    8192, "--max-num-batched-tokens", help="Most tokens in one step (longer prompts are chunked)."
)
MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="Context limit (default: the model's).")
ENABLE_PREFIX_CACHING = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching")
GPU_MEMORY_UTILIZATION = typer.Option(
    0.9,
    "--gpu-memory-utilization",
    help="Share of GPU memory for weights, activations and KV cache.",
)
PIPELINE_PARALLEL_SIZE = typer.Option(
    1,
    "--pipeline-parallel-size",
    help="Only 1: routing capture needs every MoE layer in one pipeline stage.",
)
CPU_OFFLOAD_GB = typer.Option(
    0.0, "--cpu-offload-gb", help="Only 0: routing capture does not support weight offload."
)
ENFORCE_EAGER = typer.Option(
    False,
    "--enforce-eager",
    help="No CUDA graphs: every step runs eagerly (slower, same trace). "
    "Tensor parallel runs eagerly already.",
)
MAX_CUDAGRAPH_CAPTURE_SIZE = typer.Option(
    2048,
    "--max-cudagraph-capture-size",
    help="Steps of up to this many tokens (padded) replay CUDA graphs; larger ones run "
    "eagerly at padded sizes.",
)
TENSOR_PARALLEL_SIZE = typer.Option(
    None,
    "--tensor-parallel-size",
    "-tp",
    help="Devices to split the model over, one process each (default: 1, or torchrun's "
    "process count). See docs/distributed.md.",
)
ENABLE_EXPERT_PARALLEL = typer.Option(
    False,
    "--enable-expert-parallel",
    help="With tensor parallelism: whole experts per rank instead of a slice of each.",
)
SEQUENCE_PARALLEL_MOE = typer.Option(
    False,
    "--sequence-parallel-moe",
    help="With tensor parallelism: each rank routes a slice of the tokens; capture gathers.",
)
RECORD_WEIGHTS = typer.Option(
    False,
    "--record-weights",
    help="Also capture each chosen expert's gate weight (what the model multiplies its output "
    "by), beside the ids.",
)


class WeightsDtype(str, enum.Enum):
    """How gate weights are stored (trace-format.md, ``routed_weights``)."""

    float16 = "float16"
    float32 = "float32"


WEIGHTS_DTYPE = typer.Option(
    WeightsDtype.float16,
    "--weights-dtype",
    help="How gate weights are kept (and sent): float16 or float32.",
)
FLUSH_INTERVAL = typer.Option(
    5.0, "--flush-interval", help="Seconds between flushes: the most a crash can lose."
)
FLUSH_EVERY = typer.Option(64, "--flush-every", help="Finished requests between flushes.")


def engine_config(
    *,
    block_size: int,
    num_kv_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None,
    enable_prefix_caching: bool,
    gpu_memory_utilization: float,
    seed: int,
    enforce_eager: bool,
    max_cudagraph_capture_size: int,
    capture_weights: str | None = None,
) -> EngineConfig:
    return EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        enforce_eager=enforce_eager,
        max_cudagraph_capture_size=max_cudagraph_capture_size,
        capture_weights=capture_weights,
    )
