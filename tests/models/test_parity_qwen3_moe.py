"""Qwen3-MoE: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import pytest
from support.hf_reference import make_tiny_checkpoint
from support.parity import assert_parity, assert_shape_parity, prompts

SHAPES = {
    "renormalised": dict(norm_topk_prob=True),
    "raw-probs": dict(norm_topk_prob=False, num_experts_per_tok=3),
    "mlp-only-layer": dict(mlp_only_layers=[1], num_hidden_layers=4),
    "sparse-step-2": dict(decoder_sparse_step=2, num_hidden_layers=4, num_local_experts=16),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("qwen3_moe", tmp_path, name, SHAPES[name])


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys differently from save_pretrained (num_experts, rope_theta)."""
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "hub", seed=5, config_style="hub")
    assert_parity(ckpt, prompts(5))
