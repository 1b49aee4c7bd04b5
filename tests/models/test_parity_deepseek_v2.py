"""DeepSeek-V2: recorded routing equals transformers' routers (float32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from support.hf_reference import make_tiny_checkpoint
from support.parity import (
    assert_mla_cuda_records_what_the_cpu_records,
    assert_parity,
    assert_shape_parity,
    record_dummy_trace,
)
from support.parity import prompts as parity_prompts

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import ModelError
from moetrace.layers.mla import MultiHeadLatentAttention
from moetrace.models.loader import instantiate, load_model

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

SHAPES = {
    # V2-Lite's shape: plain q_proj, greedy, 2 shared experts, YaRN with mscale.
    "lite-yarn": dict(
        q_lora_rank=None,
        n_shared_experts=2,
        first_k_dense_replace=1,
        rope_parameters=YARN,
    ),
    # V2's shape: q LoRA, group-limited greedy (2 of 4 groups), large scaling factor.
    "group-limited": dict(
        q_lora_rank=24,
        topk_method="group_limited_greedy",
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        routed_scaling_factor=16.0,
        first_k_dense_replace=0,
    ),
}


def prompts(seed: int) -> dict[str, list[int]]:
    """DeepSeek's prompt set: no short prompt, a 21-token long one."""
    return parity_prompts(seed, short=False, long=21)


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity(
        "deepseek_v2", tmp_path, name, SHAPES[name], prompt_set=prompts(len(name)), max_tokens=5
    )


def test_hub_style_keys_two_dense_layers_and_biases(tmp_path):
    """Published checkpoints spell rope as rope_theta + rope_scaling {"type": "yarn"}."""
    ckpt = make_tiny_checkpoint(
        "deepseek_v2",
        tmp_path / "hub",
        seed=7,
        config_style="hub",
        rope_parameters=YARN,
        q_lora_rank=24,
        first_k_dense_replace=2,
        num_hidden_layers=4,
        attention_bias=True,
        mlp_bias=True,
    )
    config = json.loads((ckpt / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and "rope_parameters" not in config
    assert_parity(ckpt, prompts(7), max_tokens=4, max_num_batched_tokens=8, max_num_seqs=3)


def test_dense_layers_get_no_routing_rows_in_the_trace(tmp_path):
    ckpt = make_tiny_checkpoint("deepseek_v2", tmp_path / "m", seed=2, first_k_dense_replace=2)
    lines = [{"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3}]
    trace = record_dummy_trace(ckpt, tmp_path, lines, dtype="float32")
    with h5py.File(trace, "r") as f:
        assert f.attrs["moe_layer_indices"].tolist() == [2]
        assert f.attrs["architecture"] == "DeepseekV2ForCausalLM"
        assert f["routed_experts"].shape == (6, 1, 2)


def test_real_v2_lite_config_instantiates_on_meta():
    config = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
    model = instantiate(config, "deepseek-v2-lite", torch.bfloat16, torch.device("meta"))
    assert model.moe_layer_indices == list(range(1, 27))
    assert (model.num_experts, model.top_k) == (64, 6)
    attn = model.layers[0].self_attn
    assert attn.attn.kv_cache_shapes(7, 16) == [(7, 16, 576)]  # one row of latent ‖ rope key
    assert attn.attn.scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * np.log(40) + 1) ** 2)
    assert model.layers[1].mlp.gate.dtype == torch.float32
    assert model.layers[1].mlp.shared_experts.intermediate == 2 * 1408
    names = model.expected_weight_names()
    assert "model.layers.1.mlp.experts.63.down_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names


def test_real_v2_config_instantiates_on_meta():
    config = json.loads((CONFIGS / "deepseek-v2.json").read_text())
    model = instantiate(config, "deepseek-v2", torch.bfloat16, torch.device("meta"))
    assert model.moe_layer_indices == list(range(1, 60))
    block = model.layers[1].mlp
    assert (model.num_experts, model.top_k) == (160, 6)
    assert (block.topk_method, block.num_groups, block.topk_groups) == (
        "group_limited_greedy",
        8,
        3,
    )
    assert block.scaling == 16.0
    assert model.layers[0].self_attn.attn.kv_cache_shapes(1, 16) == [(1, 16, 576)]


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(topk_method="noaux_tc"), "topk_method"),
        (dict(scoring_func="sigmoid"), "scoring_func"),
    ],
)
def test_configs_the_reference_disagrees_on_are_refused(override, message):
    config = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
    with pytest.raises(ModelError, match=message):
        instantiate({**config, **override}, "x", torch.bfloat16, torch.device("meta"))


def test_absorbed_decode_equals_expanded_attention(tmp_path):
    """The CUDA decode path (kv_b_proj absorbed, all sequences at once), forced on the CPU."""
    ckpt = make_tiny_checkpoint("deepseek_v2", tmp_path / "m", seed=3, **SHAPES["lite-yarn"])
    cpu = torch.device("cpu")
    runs = []
    for absorbed in (False, True):
        model = load_model(str(ckpt), device=cpu, dtype="float64").model
        for module in model.modules():
            if isinstance(module, MultiHeadLatentAttention):
                module.absorbed_decode = absorbed
        eng = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=3), cpu)
        for i, (rid, ids) in enumerate(prompts(3).items()):
            eng.add_request(rid, ids, SamplingParams(max_tokens=8, ignore_eos=True), index=i)
        runs.append({f.request_id: f for f in eng.run()})
    for rid, expanded in runs[0].items():
        absorbed = runs[1][rid]
        assert absorbed.output_token_ids.tolist() == expanded.output_token_ids.tolist()
        np.testing.assert_array_equal(absorbed.routed_experts, expanded.routed_experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_records_what_the_cpu_records(tmp_path):
    """MLA in float32 on CUDA; the 16-bit fused-MoE kernel is the teacher-forced test's job."""
    ckpt = make_tiny_checkpoint("deepseek_v2", tmp_path / "m", seed=4, **SHAPES["group-limited"])
    assert_mla_cuda_records_what_the_cpu_records(ckpt, prompts(4), torch.device("cuda"))
