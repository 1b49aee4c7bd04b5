"""GraniteMoE: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import pytest
from support.hf_reference import make_tiny_checkpoint
from support.parity import assert_parity, assert_shape_parity, prompts

SHAPES = {
    # hf_reference's defaults: every multiplier away from 1.
    "multipliers": dict(),
    "top3-of-16": dict(num_local_experts=16, num_experts_per_tok=3, logits_scaling=0.5),
    "tied-biased": dict(tie_word_embeddings=True, attention_bias=True, num_hidden_layers=2),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("granitemoe", tmp_path, name, SHAPES[name])


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys as rope_theta / rope_scaling / torch_dtype."""
    ckpt = make_tiny_checkpoint("granitemoe", tmp_path / "hub", seed=5, config_style="hub")
    assert_parity(ckpt, prompts(5))
