"""Real checkpoint directories for the weight-update tests (the demo, its routers changed)
and engines over them.

A trainer's step changes every weight a little; what the tests need is a
checkpoint whose routing visibly differs from the demo's, written as a
trainer writes one (config.json, tokenizer files, safetensors), so that
``moetrace record`` of it, or an engine loaded fresh from it, is an
independent reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.demo import DEMO_DIR
from moetrace.models.loader import load_model

CPU = torch.device("cpu")
PROMPTS = {"hello": [72, 101, 108, 108, 111], "code": [100, 101, 102, 32, 102, 40, 41, 58]}

DEMO_MOE_LAYERS = (1, 2, 3)
WEIGHTS = "model.safetensors"


def gate_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def demo_tensors() -> dict[str, torch.Tensor]:
    return load_file(str(DEMO_DIR / WEIGHTS))


def changed_demo(dst: Path, shift: int, *, scale: float = 1.0) -> Path:
    """The demo with each router's expert rows rolled by ``shift`` (and its attention
    output scaled by ``scale``): other experts win, other tokens follow."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in DEMO_DIR.iterdir():
        if item.name != WEIGHTS:
            shutil.copy(item, dst / item.name)
    tensors = demo_tensors()
    for layer in DEMO_MOE_LAYERS:
        name = gate_name(layer)
        tensors[name] = torch.roll(tensors[name], shift, dims=0).contiguous()
    if scale != 1.0:
        name = "model.layers.2.self_attn.o_proj.weight"
        tensors[name] = (tensors[name] * scale).contiguous()
    save_file(tensors, str(dst / WEIGHTS))
    return dst


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / WEIGHTS))


def engine_for(model_path: str, **overrides) -> LLMEngine:
    """An engine over MODEL loaded as ``record`` loads it (the demo's CPU dtype)."""
    loaded = load_model(model_path, device=CPU)
    config = EngineConfig(**{"num_kv_blocks": 64, "block_size": 4, **overrides})
    return LLMEngine(loaded.model, config, CPU)


def run(engine: LLMEngine, prompts=PROMPTS, max_tokens: int = 6, tag: str = "") -> dict:
    """Greedy runs of ``prompts`` to the end, by id (``tag`` keeps ids unique per call)."""
    for i, (rid, ids) in enumerate(prompts.items()):
        engine.add_request(tag + rid, ids, SamplingParams(max_tokens=max_tokens), index=i)
    return {f.request_id.removeprefix(tag): f for f in engine.run()}


def assert_same_routing(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid].output_token_ids.tolist() == want[rid].output_token_ids.tolist(), rid
        np.testing.assert_array_equal(got[rid].routed_experts, want[rid].routed_experts)
