"""Builders shared by the engine tests: tiny Qwen3-MoE models and request runs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import fill_dummy, instantiate
from moetrace.trace.records import FinishedRequest

CPU = torch.device("cpu")


def tiny_qwen3_config(**overrides) -> dict:
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    }
    config.update(overrides)
    return config


def tiny_model(dtype: torch.dtype = torch.float64, seed: int = 7, **overrides):
    model = instantiate(tiny_qwen3_config(**overrides), "tiny", dtype, CPU)
    fill_dummy(model, seed, std=0.3)
    return model


def run_requests(
    model,
    prompts: dict[str, list[int]],
    *,
    max_tokens: int | dict[str, int] = 6,
    sampling: dict | None = None,
    **engine_overrides,
) -> tuple[dict[str, FinishedRequest], LLMEngine]:
    """Run every prompt to the end; returns finished requests by id and the engine."""
    config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 4, **engine_overrides})
    engine = LLMEngine(model, config, CPU)
    for index, (rid, ids) in enumerate(prompts.items()):
        n = max_tokens[rid] if isinstance(max_tokens, dict) else max_tokens
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, **(sampling or {})), index=index)
    done = {f.request_id: f for f in engine.run()}
    return done, engine


def shared_prefix_prompts(seed: int, count: int, vocab: int = 97) -> dict[str, list[int]]:
    """Prompts of mixed lengths, many sharing long prefixes (to exercise the prefix cache)."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, vocab, size=int(n)).tolist() for n in (13, 21, 8)]
    prompts = {}
    for i in range(count):
        stem = stems[i % len(stems)] if i % 4 else []
        tail = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        prompts[f"r{i}"] = stem + tail
    return prompts


def assert_forward_never_syncs(
    model, device: torch.device, *, prepare: Callable[[LLMEngine], None] | None = None, **engine
) -> None:
    """A step's forward, eager and padded as graphs capture it, and its routing copy,
    with torch's sync checker set to raise.

    The step is four 30-token prompts, or what the engine schedules after
    ``prepare(engine)`` (which adds requests and may run earlier steps).  Both
    forwards run once before, unchecked: Triton compiles its kernels on first
    use, which may synchronise.
    """
    from moetrace.engine.step_plan import build_plan
    from moetrace.forward_context import forward_context

    settings = {"num_kv_blocks": 64, "block_size": 16, "max_num_seqs": 8, "enforce_eager": True}
    config = EngineConfig(**{**settings, **engine})
    eng = LLMEngine(model, config, device)
    if prepare is not None:
        prepare(eng)
    else:
        for i in range(4):
            eng.add_request(f"r{i}", list(range(10 + i, 40 + i)), SamplingParams(max_tokens=4))
    output = eng.scheduler.schedule()
    plan = build_plan(output, config.block_size)
    ids, pos, meta, _rows = eng.runner.staged_inputs(plan)
    graphs = eng.runner.graphs
    size = graphs.bucket(plan.num_tokens)
    padded_meta = graphs._stage(plan, size)

    def forwards() -> None:
        with torch.inference_mode(), forward_context(meta):
            model(ids, pos)
        with torch.inference_mode():
            graphs._forward(size, padded_meta)  # the padded step, as graphs capture it

    forwards()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forwards()
        eng.runner.transfer.start(
            eng.runner.capturer.tensors(plan.num_tokens), plan.slots, plan.slots * 0
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
