"""gpt-oss: recorded routing equals transformers' routers (float32, CPU); MXFP4 experts load exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.gpt_oss import mxfp4_twins
from support.hf_reference import make_tiny_checkpoint, reference_routing
from support.parity import assert_parity, assert_shape_parity, prompts, record

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.layers.mxfp4 import dequantize_mxfp4
from moetrace.models.loader import load_model

SHAPES = {
    # hf_reference's defaults: sliding (window 8) / full / sliding, YaRN, top-2 of 8.
    "default": dict(),
    # Tight clamp so both SwiGLU clamps bite; small windows everywhere.
    "top4-of-16-clamped": dict(
        num_local_experts=16,
        num_experts_per_tok=4,
        swiglu_limit=0.5,
        sliding_window=5,
        layer_types=["sliding_attention"] * 3,
    ),
    "full-attention-no-bias": dict(
        attention_bias=False, num_hidden_layers=2, layer_types=["full_attention"] * 2
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity("gpt_oss", tmp_path, name, SHAPES[name])


def test_hub_style_config_keys(tmp_path):
    """Published checkpoints spell keys as rope_theta / rope_scaling (yarn) / torch_dtype."""
    ckpt = make_tiny_checkpoint("gpt_oss", tmp_path / "hub", seed=5, config_style="hub")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn"
    assert_parity(ckpt, prompts(5))


# ------------------------------------------------------------------- MXFP4


def test_dequantize_mxfp4_by_hand():
    """Two blocks of 32: low nibble first; scales 2**(s - 127)."""
    blocks = torch.zeros(2, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # low 0b0001 = 0.5, high 0b0010 = 1.0
    blocks[0, 1] = 0xF8  # low 0b1000 = -0.0, high 0b1111 = -6.0
    blocks[0, 15] = 0x7B  # low 0b1011 = -1.5, high 0b0111 = 6.0
    blocks[1, 0] = 0x53  # low 0b0011 = 1.5, high 0b0101 = 3.0
    scales = torch.tensor([128, 125], dtype=torch.uint8)  # x2, x1/4
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    expected = torch.zeros(64)
    expected[[0, 1, 2, 3, 30, 31]] = torch.tensor([1.0, 2.0, -0.0, -12.0, -3.0, 12.0])
    expected[[32, 33]] = torch.tensor([0.375, 0.75])
    assert out.shape == (64,)
    assert torch.equal(out, expected)
    assert torch.signbit(out[2])  # -0.0 stays negative zero


def test_mxfp4_checkpoint_stays_mxfp4_and_computes_like_its_dense_twin(tmp_path):
    """Experts keep the checkpoint's bytes; decoded, they are the dense twin's values exactly."""
    dense_dir, quant_dir = mxfp4_twins(tmp_path)
    cpu = torch.device("cpu")
    dense_model = load_model(str(dense_dir), device=cpu, dtype="float32").model
    quant_model = load_model(str(quant_dir), device=cpu, dtype="float32").model
    quant_params = dict(quant_model.named_parameters())
    for name, param in dense_model.named_parameters():
        if name.endswith(("experts.w13", "experts.w2")):
            assert quant_params[name].dtype == torch.uint8, name
        else:
            assert torch.equal(param, quant_params[name]), name
    for dense_layer, quant_layer in zip(dense_model.layers, quant_model.layers, strict=True):
        dense, quant = dense_layer.mlp.experts, quant_layer.mlp.experts
        for e in range(dense.num_experts):
            w13, w2 = quant._dense_weights(e, torch.float32)
            inter = dense.intermediate
            assert torch.equal(w13[0::2], dense.w13[e, :inter])  # gate rows
            assert torch.equal(w13[1::2], dense.w13[e, inter:])  # up rows
            assert torch.equal(w2, dense.w2[e])
    got = record(quant_dir, prompts(3), 4)["done"]
    want = record(dense_dir, prompts(3), 4)["done"]
    for rid, done in want.items():
        assert done.output_token_ids.tolist() == got[rid].output_token_ids.tolist(), rid
        np.testing.assert_array_equal(done.routed_experts, got[rid].routed_experts, err_msg=rid)


# ------------------------------------------------------------------- bf16


def test_bf16_teacher_forced_routing_is_transformers_bit_for_bit_on_cpu(tmp_path):
    """In bf16 on the CPU the plain path rounds where transformers' eager modules round.

    Sinks: the row max (sink included) is subtracted in bf16 and the softmax
    returns bf16, as ``eager_attention_forward`` does; expert biases are added
    after the matmul's own rounding, as ``GptOssExperts`` does.  Every rounding
    then agrees, so the routing of a whole teacher-forced prompt is identical in
    every layer (before those two changes the top-k sets of 2%, 6% and 21% of
    the rows of layers 1-3 differed in this shape).
    """
    shape = dict(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=32,
        intermediate_size=64,
        num_local_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    ckpt = make_tiny_checkpoint("gpt_oss", tmp_path / "bf16", seed=4, dtype=torch.bfloat16, **shape)
    sequence = np.random.default_rng(4).integers(3, 300, 96).tolist()
    model = load_model(str(ckpt), device=torch.device("cpu"), dtype="bfloat16").model
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=16, block_size=16), torch.device("cpu"))
    engine.add_request("forced", sequence, SamplingParams(max_tokens=1))  # one prefill step
    (done,) = engine.run()
    ref = reference_routing(ckpt, sequence, dtype=torch.bfloat16)["topk_ids"]
    np.testing.assert_array_equal(done.routed_experts, ref)
