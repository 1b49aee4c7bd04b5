"""PhiMoE: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from support.hf_reference import make_tiny_checkpoint
from support.parity import assert_parity, assert_shape_parity, prompts

from moetrace.errors import ModelError
from moetrace.models.phimoe import PhimoeForCausalLM, sparsemixer_top2

LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.3, 2.0, 4.5],
    "long_factor": [1.5, 3.0, 6.0, 9.0],
    "short_mscale": 1.1,
    "long_mscale": 1.4,
    "original_max_position_embeddings": 64,
}

SHAPES = {
    "default": dict(),
    # A wide jitter window lets several logits into each pick's softmax; biases everywhere.
    "wide-jitter-biases": dict(
        router_jitter_noise=0.3, num_local_experts=16, attention_bias=True, lm_head_bias=True
    ),
    "sliding-window": dict(sliding_window=5, num_hidden_layers=2),
    "longrope": dict(rope_parameters=LONGROPE, num_hidden_layers=2),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("phimoe", tmp_path, name, SHAPES[name])


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys as rope_theta / rope_scaling / torch_dtype."""
    ckpt = make_tiny_checkpoint(
        "phimoe", tmp_path / "hub", seed=5, config_style="hub", rope_parameters=LONGROPE
    )
    assert_parity(ckpt, prompts(5))


def test_sparsemixer_weights_by_hand():
    """Logits 4, 3.9, 1, -2 with eps 0.01: pick 0 alone in its window, then 1 against 0.

    First pick: (4 - 3.9) / 4 = 0.025 > 0.02 masks expert 1, so weight 1.  Second:
    the threshold is 3.9 and expert 0's logit lies above it (unmasked).
    """
    logits = torch.tensor([[4.0, 3.9, 1.0, -2.0]], dtype=torch.float64)
    weights, ids = sparsemixer_top2(logits, 0.01)
    assert ids.tolist() == [[0, 1]]
    second = torch.softmax(torch.tensor([-float("inf"), 3.9, -float("inf"), -float("inf")]), 0)
    assert weights[0, 0].item() == 1.0
    assert weights[0, 1].item() == pytest.approx(second[1].item())


def test_longrope_caps_context_and_other_top_k_is_refused():
    config = {
        "architectures": ["PhimoeForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 50,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rope_scaling": {k: v for k, v in LONGROPE.items() if k != "rope_theta"},
    }
    assert PhimoeForCausalLM(config).max_model_len == 64
    with pytest.raises(ModelError, match="exactly 2 experts"):
        PhimoeForCausalLM({**config, "num_experts_per_tok": 3})
