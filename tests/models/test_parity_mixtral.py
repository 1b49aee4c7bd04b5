"""Mixtral: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import pytest
from support.hf_reference import make_tiny_checkpoint, reference_routing
from support.parity import assert_parity, assert_shape_parity, prompts, record_dummy_trace

from moetrace.trace.reader import open_trace

SHAPES = {
    "top2": dict(),
    "top1": dict(num_experts_per_tok=1),
    "top3-of-16": dict(num_local_experts=16, num_experts_per_tok=3, num_hidden_layers=2),
    # Shorter than the long prompt, a step and two blocks: the window edge moves inside steps.
    "sliding-window-5": dict(sliding_window=5),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("mixtral", tmp_path, name, SHAPES[name])


def test_sliding_window_changes_the_reference_routing(tmp_path):
    """Guards the window test above: with this window and prompt the window is not a no-op."""
    tokens = prompts(0)["long"]
    windowed = make_tiny_checkpoint("mixtral", tmp_path / "w", seed=3, sliding_window=5)
    full = make_tiny_checkpoint("mixtral", tmp_path / "f", seed=3)
    a = reference_routing(windowed, tokens)["topk_ids"]
    b = reference_routing(full, tokens)["topk_ids"]
    assert (a[:5] == b[:5]).all() and (a[5:] != b[5:]).any()


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys differently from save_pretrained (torch_dtype, rope_theta)."""
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "hub", seed=5, config_style="hub")
    assert_parity(ckpt, prompts(5), max_num_batched_tokens=8)


def test_trace_metadata_from_dummy_weights(tmp_path):
    ckpt = make_tiny_checkpoint(
        "mixtral", tmp_path / "m", seed=1, num_local_experts=16, num_experts_per_tok=3
    )
    lines = [{"id": str(i), "prompt_token_ids": [5 + i, 6, 7]} for i in range(2)]
    with open_trace(record_dummy_trace(ckpt, tmp_path, lines)) as trace:
        meta = trace.metadata
        assert meta["architecture"] == "MixtralForCausalLM"
        assert list(meta["moe_layer_indices"]) == [0, 1, 2]
        assert (trace.num_experts, trace.top_k) == (16, 3)
        assert [r.routed_experts.shape for r in trace] == [(4, 3, 3)] * 2
