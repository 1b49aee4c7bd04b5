"""Refuse, at start and in one line, parallel settings that could not capture correctly.

Checked from config.json alone, before any process starts or weight loads.
Each family admitted here has been run at TP=2 on the CPU and recorded the
TP=1 trace exactly (tests/distributed/test_sharding.py); the rest are refused
rather than trusted: OLMoE normalises q and k over all heads (a split would
need its own all-reduce), DeepSeek's MLA attention and gpt-oss's sinks and
expert biases have no sharded path yet, and the others are simply untested.
"""

from __future__ import annotations

import os

import torch

from moetrace.distributed.state import ParallelConfig
from moetrace.errors import MoetraceError
from moetrace.models.config_fields import num_routed_experts

# Architecture -> config keys of the MoE expert width and of any dense/shared MLP width.
TENSOR_PARALLEL_FAMILIES: dict[str, dict[str, tuple[str, ...]]] = {
    "Qwen3MoeForCausalLM": {"experts": ("moe_intermediate_size",), "dense": ("intermediate_size",)},
    "Qwen2MoeForCausalLM": {
        "experts": ("moe_intermediate_size",),
        "dense": ("intermediate_size", "shared_expert_intermediate_size"),
    },
    "MixtralForCausalLM": {"experts": ("intermediate_size",), "dense": ()},
}
SHARED_EXPERT_FAMILIES = ("Qwen2MoeForCausalLM",)


def _architecture(config: dict) -> str:
    return next(iter(config.get("architectures") or []), "unknown")


def _has_dense_layers(config: dict) -> bool:
    if config.get("mlp_only_layers"):
        return True
    return int(config.get("decoder_sparse_step", 1) or 1) > 1


def check_parallel_config(parallel: ParallelConfig) -> None:
    """Settings that are wrong whatever the model."""
    tp = parallel.tensor_parallel_size
    if tp < 1:
        raise MoetraceError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if tp == 1 and parallel.enable_expert_parallel:
        raise MoetraceError("--enable-expert-parallel needs --tensor-parallel-size of 2 or more")
    if tp == 1 and parallel.sequence_parallel_moe:
        raise MoetraceError("--sequence-parallel-moe needs --tensor-parallel-size of 2 or more")


def check_model_shardable(config: dict, parallel: ParallelConfig) -> None:
    """The model's shapes split evenly over the ranks, in a family with a tested sharded path."""
    tp = parallel.tensor_parallel_size
    if tp == 1:
        return
    arch = _architecture(config)
    keys = TENSOR_PARALLEL_FAMILIES.get(arch)
    if keys is None:
        raise MoetraceError(
            f"--tensor-parallel-size {tp}: {arch} has no tensor-parallel path yet; supported: "
            + ", ".join(sorted(TENSOR_PARALLEL_FAMILIES))
        )
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % tp:
        raise MoetraceError(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads"
        )
    if kv_heads % tp and tp % kv_heads:
        raise MoetraceError(
            f"--tensor-parallel-size {tp} neither divides nor is a multiple of the {kv_heads} "
            "key/value heads"
        )
    experts = num_routed_experts(config)
    if parallel.enable_expert_parallel:
        if experts % tp:
            raise MoetraceError(
                f"--enable-expert-parallel: {tp} ranks do not divide the {experts} experts"
            )
    else:
        for key in keys["experts"]:
            _check_divides(config, key, tp, "the experts' intermediate size")
    dense_keys = keys["dense"]
    if arch == "Qwen3MoeForCausalLM" and not _has_dense_layers(config):
        dense_keys = ()  # intermediate_size is unused when every layer routes
    for key in dense_keys:
        _check_divides(config, key, tp, "a dense MLP's intermediate size")
    if parallel.sequence_parallel_moe and arch in SHARED_EXPERT_FAMILIES:
        raise MoetraceError(
            f"--sequence-parallel-moe: {arch} has shared experts, which the chunked MoE block "
            "cannot sum yet; drop --sequence-parallel-moe"
        )


def _check_divides(config: dict, key: str, tp: int, what: str) -> None:
    value = config.get(key)
    if value is not None and int(value) % tp:
        raise MoetraceError(f"--tensor-parallel-size {tp} does not divide {what} ({key} = {value})")


def check_devices(parallel: ParallelConfig, device: str, dtype: str, *, torchrun: bool) -> None:
    """The machine can run the group: enough GPUs, a dtype gloo and the CPU handle."""
    tp = parallel.tensor_parallel_size
    if tp == 1:
        return
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not cuda and dtype == "float16":
        raise MoetraceError(
            "--dtype float16 with --tensor-parallel-size on the CPU is refused: CPU float16 "
            "matmuls are slow and inexact; use float32 or float64"
        )
    if cuda and not torchrun and torch.cuda.device_count() < tp:
        raise MoetraceError(
            f"--tensor-parallel-size {tp} needs {tp} GPUs; torch sees {torch.cuda.device_count()}"
        )


def torchrun_world_size() -> int | None:
    """The process count torchrun started, or None when not under a launcher."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and "RANK" in os.environ else None


def resolve_parallel(
    tensor_parallel_size: int | None, enable_expert_parallel: bool, sequence_parallel_moe: bool
) -> ParallelConfig:
    """The group size: as given, or torchrun's process count; the two must agree."""
    world = torchrun_world_size()
    tp = tensor_parallel_size
    if tp is None:
        tp = world or 1
    elif world is not None and world != tp:
        raise MoetraceError(
            f"torchrun started {world} processes but --tensor-parallel-size is {tp}; they must "
            "be equal (data-parallel shards are separate runs: --num-shards/--shard-index)"
        )
    parallel = ParallelConfig(tp, enable_expert_parallel, sequence_parallel_moe)
    check_parallel_config(parallel)
    return parallel
