"""benchmarks/rollouts.py: each step's shape and the experts it reached, rebuilt after the
run from the finished requests, equal what the engine captured at that step; and the
script end to end on the CPU at a tiny size."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.benchmarks import BENCHMARKS, benchmark_module
from support.engine import CPU, tiny_model

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine

rollouts = benchmark_module("rollouts")
workloads = benchmark_module("workloads")


def _grpo(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    workloads.add_workload_arguments(parser, num_prompts=2, choices=workloads.WORKLOADS)
    args = parser.parse_args(["--workload", "grpo"])
    settings = {"temperature": 1.0, "seed": 0, "logprobs": True, **given}
    return argparse.Namespace(**{**vars(args), **settings})


def test_rebuilt_steps_reach_the_experts_the_engine_captured() -> None:
    model = tiny_model(torch.float32, vocab_size=500)  # the workload draws ids from 100 up
    # Chunked prompts beside decodes, and too few blocks for every sequence: preemptions.
    config = EngineConfig(num_kv_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    engine = LLMEngine(model, config, CPU)
    captured: list[np.ndarray] = []
    store = engine.routing_manager.store_batch

    def keeping(lists) -> None:
        store(lists)
        captured.append(lists.routing.copy())

    engine.routing_manager.store_batch = keeping
    args = _grpo(num_prompts=2, samples_per_prompt=3, prompt_len=14, output_range="3-20")
    prompts, output_lens = workloads.prompts(args, model.vocab_size)
    run = rollouts.run_rollouts(engine, prompts, output_lens, args)
    shapes = rollouts.step_shapes(run, model.num_experts)

    assert run.preemptions > 0
    assert len(shapes) == len(captured) == engine.stats.steps
    for shape, rows in zip(shapes, captured, strict=True):
        assert shape.num_tokens == len(rows)
        distinct = [len(np.unique(rows[:, layer])) for layer in range(rows.shape[1])]
        assert shape.experts_reached.tolist() == distinct
    assert sum(s.sampled_rows for s in shapes) == sum(output_lens)
    assert sorted(f.output_len for f in run.finished) == sorted(output_lens)


def test_importing_the_benchmark_left_sys_path_alone() -> None:
    # benchmarks/kernels.py on the path would shadow the Hugging Face kernels package.
    assert str(BENCHMARKS) not in sys.path


def test_tail_starts_when_the_share_has_finished() -> None:
    finished_at = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 20.0])
    tail = rollouts.tail(finished_at, 25.0, share=0.8)
    assert tail == {"requests": 2, "from_s": 8.0, "seconds": 17.0, "share_of_run": 17.0 / 25.0}


@pytest.mark.slow  # a process that imports torch and measures the CPU's rates
def test_the_script_runs_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "rollouts.json"
    argv = ["--config", "tiny-qwen3", "--num-prompts", "2", "--samples-per-prompt", "4"]
    argv += ["--prompt-len", "24", "--output-range", "4-40", "--warmup-tokens", "2"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "rollouts.py"), *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    _, output_lens = workloads.prompts(
        _grpo(num_prompts=2, samples_per_prompt=4, prompt_len=24, output_range="4-40"), 1000
    )
    assert result["requests"] == 8
    assert result["output_tokens"] == sum(output_lens)
    assert result["prompt_tokens"] == 8 * 24
    assert result["kv_cache"]["tokens"] == 16 * result["kv_cache"]["blocks"] > 0
    assert result["bound_s"] > 0 and result["wall_over_bound"] > 0
    phases = result["phases"]
    assert phases["with_prefill"]["steps"] + phases["decode_only"]["steps"] == result["steps"]
    assert 0 <= result["tail"]["seconds"] <= result["seconds"]
    assert result["batch_over_time"][-1]["finished"] == 8
    assert "x of the bound" in done.stdout and "tail:" in done.stdout
