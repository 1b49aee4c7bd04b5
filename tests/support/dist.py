"""Helpers of the distributed tests: tiny checkpoints of several families, gloo process groups.

Checkpoints are written from our own models through their weight maps (the
inverse of loading), so no transformers import is needed and every family's
checkpoint names are exactly the ones its loader expects.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from moetrace.config import EngineConfig
from moetrace.distributed.sharding import load_model_for_rank
from moetrace.distributed.state import (
    ParallelConfig,
    ParallelState,
    TensorParallelLayout,
    set_parallel_state,
)
from moetrace.engine.launch import WorkerSpec, init_group, leave_group, serve_worker
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.step_sync import end_steps
from moetrace.models.loader import fill_dummy, instantiate
from moetrace.models.source import resolve_model
from support.engine import shared_prefix_prompts, tiny_qwen3_config

CPU = torch.device("cpu")


def tiny_mixtral_config(**overrides) -> dict:
    config = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    }
    return {**config, **overrides}


def tiny_qwen2_moe_config(**overrides) -> dict:
    config = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "qkv_bias": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    }
    return {**config, **overrides}


CONFIGS = {
    "qwen3": tiny_qwen3_config,
    "mixtral": tiny_mixtral_config,
    "qwen2_moe": tiny_qwen2_moe_config,
}


def write_checkpoint(config: dict, out_dir: Path, *, seed: int = 7, std: float = 0.3) -> Path:
    """A float64 checkpoint of random weights (large enough to make routing non-trivial)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": "float64"}
    model = instantiate(config, str(out_dir), torch.float64, CPU)
    fill_dummy(model, seed, std=std)
    tensors = {
        name: model.weights.destination(name).clone().contiguous() for name in model.weights.targets
    }
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def write_prompts(path: Path, prompts: dict[str, list[int]], max_tokens: int = 6) -> Path:
    lines = [
        json.dumps({"id": rid, "prompt_token_ids": ids, "max_tokens": max_tokens})
        for rid, ids in prompts.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def default_prompts() -> dict[str, list[int]]:
    return shared_prefix_prompts(seed=5, count=8)


@dataclass
class Scenario:
    """One engine run: a checkpoint, parallel flags, engine settings, sampling."""

    name: str
    model: str
    load_format: str = "auto"
    expert_parallel: bool = False
    sequence_parallel: bool = False
    engine: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    max_tokens: int = 6


def engine_config(scenario: Scenario) -> EngineConfig:
    return EngineConfig(**{"num_kv_blocks": 128, "block_size": 4, **scenario.engine})


def run_engine(scenario: Scenario, prompts: dict[str, list[int]]) -> dict:
    """Rank 0's (or a single device's) run: {request id: (output tokens, routing rows)}."""
    loaded = load_model_for_rank(
        scenario.model, device=CPU, dtype="float64", load_format=scenario.load_format
    )
    engine = LLMEngine(loaded.model, engine_config(scenario), CPU)
    params = SamplingParams(max_tokens=scenario.max_tokens, ignore_eos=True, **scenario.sampling)
    for index, (rid, ids) in enumerate(prompts.items()):
        engine.add_request(rid, ids, params, index=index)
    done = {f.request_id: f for f in engine.run()}
    engine.block_manager.check_no_leaks()
    return {
        "results": {r: (f.output_token_ids, f.routed_experts) for r, f in done.items()},
        "preemptions": engine.stats.preemptions,
    }


GroupJob = tuple[object, ParallelConfig, WorkerSpec, Callable[[], object]]


def _group_rank(
    rank: int, world: int, rendezvous: str, device_type: str, jobs: list[GroupJob], out: str
) -> None:
    """One process of a tensor-parallel group running each job in turn.

    A job is (result key, parallel flags, what the workers load, rank 0's
    run); rank 0 drives the run, the other ranks serve its steps.
    """
    if device_type == "cpu":
        torch.set_num_threads(1)
    state = init_group(ParallelConfig(world), rank, rank, device_type, f"file://{rendezvous}")
    results = {}
    try:
        for key, config, spec, drive in jobs:
            state = ParallelState(
                config, TensorParallelLayout.of(config, rank), state.comm, state.device
            )
            set_parallel_state(state)
            if rank != 0:
                serve_worker(state)
                continue
            state.comm.broadcast_object(spec)
            results[key] = drive()
            end_steps(state)
    finally:
        leave_group()
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(results))


def run_group(jobs: list[GroupJob], tmp: Path, device_type: str = "cpu", world: int = 2) -> dict:
    """Rank 0's results by job key, from a ``world``-process group (gloo on CPU, NCCL on CUDA)."""
    out = tmp / "results.pkl"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (world, str(tmp / "rendezvous"), device_type, jobs, str(out))
    mp.spawn(_group_rank, args=args, nprocs=world)
    return pickle.loads(out.read_bytes())


def run_tensor_parallel(scenarios: list[Scenario], tmp: Path, world: int = 2) -> dict:
    """Run the scenarios on a ``world``-process gloo group; rank 0's results by scenario name."""
    jobs = [
        (
            scenario.name,
            ParallelConfig(world, scenario.expert_parallel, scenario.sequence_parallel),
            WorkerSpec(
                resolve_model(scenario.model),
                "cpu",
                "float64",
                scenario.load_format,
                0,
                engine_config(scenario),
            ),
            partial(run_engine, scenario, default_prompts()),
        )
        for scenario in scenarios
    ]
    return run_group(jobs, tmp, "cpu", world)


def assert_same_results(got: dict, want: dict, label: str) -> None:
    assert set(got) == set(want), label
    for rid, (tokens, rows) in want.items():
        np.testing.assert_array_equal(got[rid][0], tokens, err_msg=f"{label} {rid} tokens")
        np.testing.assert_array_equal(got[rid][1], rows, err_msg=f"{label} {rid} routing")


def teacher_forced_prompts(trace_path: Path, out: Path) -> Path:
    """Each request's whole run-through sequence as a prompt of one more token.

    Recording these, two runs route exactly the same token sequences, so
    their rows compare layer by layer even where their generations parted.
    """
    from moetrace import open_trace

    lines = []
    with open_trace(trace_path) as trace:
        for r in trace:
            ids = [*r.prompt_token_ids.tolist(), *r.output_token_ids.tolist()[:-1]]
            lines.append(json.dumps({"id": r.id, "prompt_token_ids": ids, "max_tokens": 1}))
    out.write_text("\n".join(lines) + "\n")
    return out


def layer_agreement(a: Path, b: Path) -> np.ndarray:
    """Per MoE layer: the share of rows whose top-k ids (in router order) are equal."""
    from moetrace import open_trace

    with open_trace(a) as ta, open_trace(b) as tb:
        want = {r.id: r.routed_experts for r in ta}
        got = {r.id: r.routed_experts for r in tb}
    assert set(want) == set(got)
    same = np.concatenate([(want[k] == got[k]).all(axis=-1) for k in want])  # [rows, layers]
    return same.mean(axis=0)


def router_inputs_and_rows(model_dir: str, device, engine_config: EngineConfig, prompts) -> dict:
    """Each prompt's recorded rows and every MoE block's input in its prefill, on the host.

    One request at a time with ``max_tokens=1``: its single step is its prefill,
    so each block sees exactly the prompt's tokens, in order.
    """
    loaded = load_model_for_rank(model_dir, device=device, dtype="bfloat16", load_format="dummy")
    model = loaded.model
    engine = LLMEngine(model, engine_config, device)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args, i=block.moe_index: inputs.__setitem__(i, args[0].detach().cpu())
        )
        for block in model.moe_blocks()
    ]
    requests = []
    for index, ids in enumerate(prompts):
        inputs.clear()
        engine.add_request(f"r{index}", ids, SamplingParams(max_tokens=1), index=index)
        (done,) = list(engine.run())
        requests.append((done.routed_experts, dict(inputs)))
    for hook in hooks:
        hook.remove()
    gates = {block.moe_index: block.gate.detach().cpu() for block in model.moe_blocks()}
    return {"gates": gates, "requests": requests}


def run_bf16_router_group(
    model_dir: Path, prompts: list[list[int]], tmp: Path, device_type: str = "cuda"
) -> dict:
    """{expert_parallel: rank 0's rows and router inputs} from a 2-process group, in bf16."""
    engine = EngineConfig(num_kv_blocks=256, max_num_seqs=8)
    device = torch.device("cuda", 0) if device_type == "cuda" else CPU
    jobs = [
        (
            expert_parallel,
            ParallelConfig(2, expert_parallel),
            WorkerSpec(resolve_model(str(model_dir)), device_type, "bfloat16", "dummy", 0, engine),
            partial(router_inputs_and_rows, str(model_dir), device, engine, prompts),
        )
        for expert_parallel in (False, True)
    ]
    return run_group(jobs, tmp, device_type)
