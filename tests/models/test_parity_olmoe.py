"""OLMoE: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.hf_reference import make_tiny_checkpoint
from support.parity import assert_parity, assert_shape_parity, prompts, record_dummy_trace

from moetrace.models.loader import instantiate
from moetrace.trace.reader import open_trace

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {
    "raw-probs": dict(norm_topk_prob=False),
    "renormalised-top4": dict(norm_topk_prob=True, num_experts_per_tok=4),
    # Tight enough that most q/k/v entries of the tiny model are clamped.
    "clip-qkv": dict(clip_qkv=0.3, num_experts_per_tok=3),
    "top1-attention-bias": dict(num_experts_per_tok=1, attention_bias=True, norm_topk_prob=True),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("olmoe", tmp_path, name, SHAPES[name])


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys differently from save_pretrained (torch_dtype, rope_theta)."""
    ckpt = make_tiny_checkpoint("olmoe", tmp_path / "hub", seed=5, config_style="hub")
    assert_parity(ckpt, prompts(5), max_num_batched_tokens=8)


def test_trace_metadata_from_dummy_weights(tmp_path):
    ckpt = make_tiny_checkpoint("olmoe", tmp_path / "m", seed=1, num_experts_per_tok=3)
    lines = [{"id": str(i), "prompt_token_ids": [5 + i, 6, 7]} for i in range(2)]
    with open_trace(record_dummy_trace(ckpt, tmp_path, lines)) as trace:
        meta = trace.metadata
        assert meta["architecture"] == "OlmoeForCausalLM"
        assert list(meta["moe_layer_indices"]) == [0, 1, 2]
        assert (trace.num_experts, trace.top_k) == (8, 3)
        assert [r.routed_experts.shape for r in trace] == [(4, 3, 3)] * 2


def test_olmoe_1b_7b_benchmark_config_instantiates():
    config = json.loads((ROOT / "benchmarks" / "configs" / "olmoe-1b-7b.json").read_text())
    model = instantiate(config, "olmoe-1b-7b", torch.bfloat16, torch.device("meta"))
    assert (model.num_experts, model.top_k, model.moe_layer_indices) == (64, 8, list(range(16)))
    assert model.layers[0].self_attn.q_norm.weight.shape == (2048,)
    assert model.layers[0].mlp.experts.w13.shape == (64, 2048, 2048)
    total = sum(p.numel() for p in model.parameters())
    assert 6.8e9 < total < 7.0e9  # OLMoE-1B-7B: 6.9B parameters
    assert len(model.expected_weight_names()) == 16 * (64 * 3 + 9) + 3
