"""Qwen3-MoE: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import make_tiny_checkpoint
from parity import assert_parity

SHAPES = {
    "renormalised": dict(norm_topk_prob=True),
    "raw-probs": dict(norm_topk_prob=False, num_experts_per_tok=3),
    "mlp-only-layer": dict(mlp_only_layers=[1], num_hidden_layers=4),
    "sparse-step-2": dict(decoder_sparse_step=2, num_hidden_layers=4, num_local_experts=16),
}


def prompts(seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 300, 9).tolist()
    return {
        "short": rng.integers(0, 300, 3).tolist(),
        "long": rng.integers(0, 300, 23).tolist(),
        "shared-a": shared + rng.integers(0, 300, 4).tolist(),
        "shared-b": shared + rng.integers(0, 300, 6).tolist(),
    }


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / name, seed=len(name), **SHAPES[name])
    # Small steps and blocks: chunked prefill, prefix hits and decode all take part.
    assert_parity(ckpt, prompts(len(name)), max_num_batched_tokens=8, max_num_seqs=3)


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys differently from save_pretrained (num_experts, rope_theta)."""
    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "hub", seed=5, config_style="hub")
    assert_parity(ckpt, prompts(5))
