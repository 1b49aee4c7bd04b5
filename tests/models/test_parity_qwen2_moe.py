"""Qwen2-MoE: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from support.hf_reference import make_tiny_checkpoint
from support.parity import assert_parity, assert_shape_parity, prompts, record_dummy_trace

from moetrace.models.loader import load_model
from moetrace.trace.reader import open_trace

SHAPES = {
    "raw-probs": dict(norm_topk_prob=False),
    "renormalised-top3-small-shared": dict(
        norm_topk_prob=True, num_experts_per_tok=3, shared_expert_intermediate_size=8
    ),
    "mlp-only-layer": dict(mlp_only_layers=[0], num_hidden_layers=4),
    "sparse-step-2": dict(
        decoder_sparse_step=2, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4
    ),
    # config.json lists layer_types: layer 0 slides (window 5), the others attend fully.
    "sliding-window-5": dict(
        use_sliding_window=True, sliding_window=5, max_window_layers=2, num_hidden_layers=4
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("qwen2_moe", tmp_path, name, SHAPES[name])


def test_published_config_without_layer_types(tmp_path):
    """Hub spellings, and no layer_types or qkv_bias keys (Qwen1.5-MoE's config.json has neither).

    The sliding layers then follow transformers' default rule: even layers
    below max_window_layers.
    """
    ckpt = make_tiny_checkpoint(
        "qwen2_moe",
        tmp_path / "hub",
        seed=5,
        config_style="hub",
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=3,
        num_hidden_layers=4,
    )
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    assert config.pop("layer_types") and config.pop("qkv_bias") is True
    path.write_text(json.dumps(config))
    model = load_model(str(ckpt), device=torch.device("cpu"), dtype="float32").model
    windows = [layer.self_attn.attn.sliding_window for layer in model.layers]
    assert windows == [5, None, 5, None]
    assert_parity(ckpt, prompts(5), max_num_batched_tokens=8)


def test_trace_metadata_from_dummy_weights(tmp_path):
    ckpt = make_tiny_checkpoint(
        "qwen2_moe",
        tmp_path / "m",
        seed=1,
        num_hidden_layers=4,
        mlp_only_layers=[1],
        num_experts=16,
        num_experts_per_tok=3,
    )
    lines = [{"id": str(i), "prompt_token_ids": [5 + i, 6, 7]} for i in range(2)]
    with open_trace(record_dummy_trace(ckpt, tmp_path, lines)) as trace:
        meta = trace.metadata
        assert meta["architecture"] == "Qwen2MoeForCausalLM"
        assert list(meta["moe_layer_indices"]) == [0, 2, 3]
        assert (trace.num_experts, trace.top_k) == (16, 3)
        assert [r.routed_experts.shape for r in trace] == [(4, 3, 3)] * 2
