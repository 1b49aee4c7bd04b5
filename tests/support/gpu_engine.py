"""Models and runs on CUDA that the GPU engine, sampling, weights and replay tests share."""

from __future__ import annotations

import numpy as np
import torch

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import fill_dummy, instantiate
from support.engine import shared_prefix_prompts, tiny_qwen3_config

CUDA = torch.device("cuda")


def gpu_model(dtype: torch.dtype, **overrides):
    config = tiny_qwen3_config(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        **overrides,
    )
    model = instantiate(config, "gpu", dtype, torch.device("cpu"))
    fill_dummy(model, 11, std=0.3)
    return model.to(CUDA)


def run(model, prompts, **engine):
    config = EngineConfig(**{"num_kv_blocks": 512, "block_size": 16, **engine})
    eng = LLMEngine(model, config, CUDA)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=12), index=i)
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return done


def mixed_workload(seed: int, count: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Prompts of 1 to 70 tokens (some sharing prefixes) and 1 to 20 new tokens each, so
    requests finish at different times and most steps mix prefill chunks with decodes."""
    rng = np.random.default_rng(seed)
    prompts = shared_prefix_prompts(seed=seed, count=count)
    for rid in list(prompts)[::3]:
        prompts[rid] = prompts[rid] + rng.integers(0, 97, int(rng.integers(20, 60))).tolist()
    max_tokens = {rid: int(rng.integers(1, 21)) for rid in prompts}
    return prompts, max_tokens


def run_counting(model, prompts, max_tokens, abort_after=None, **engine):
    """Run to the end; also count steps by kind (mixed or decode-only, replayed or eager).
    ``abort_after``: (step number, request ids) aborted once that many steps have run."""
    config = EngineConfig(**{"num_kv_blocks": 512, "block_size": 16, **engine})
    eng = LLMEngine(model, config, CUDA)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens[rid]), index=i)
    kinds: dict[str, int] = {}
    graphs = eng.runner.graphs
    original = graphs.run

    def counted(plan, fill):
        size = graphs.bucket(plan.num_tokens)
        replayed = size in graphs.graphs
        kind = ("decode" if plan.decode_only else "mixed") + ("/graph" if replayed else "/eager")
        kinds[kind] = kinds.get(kind, 0) + 1
        if graphs.pads_per_token(plan, size) and size in graphs.decode_graphs:
            kinds["decode-only graph"] = kinds.get("decode-only graph", 0) + 1
        return original(plan, fill)

    graphs.run = counted
    done, steps = {}, 0
    while eng.has_unfinished():
        for f in eng.step():
            done[f.request_id] = f
        steps += 1
        if abort_after is not None and steps == abort_after[0]:
            for f in eng.abort(abort_after[1]):
                done[f.request_id] = f
    eng.block_manager.check_no_leaks()
    return done, kinds, eng.stats
