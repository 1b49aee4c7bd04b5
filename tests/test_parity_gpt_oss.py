"""gpt-oss: recorded routing equals transformers' routers (float32, CPU); MXFP4 experts load exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_reference import make_tiny_checkpoint
from parity import assert_parity, assert_shape_parity, prompts
from safetensors.torch import load_file, save_file

from moetrace.models.loader import load_model
from moetrace.models.mxfp4 import dequantize_mxfp4

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


def _e2m1(code: np.ndarray) -> np.ndarray:
    """Independent decoder from the bit fields: sign, 2-bit exponent (bias 1), 1-bit mantissa."""
    sign = np.where(code & 0b1000, -1.0, 1.0)
    exp, man = (code >> 1) & 0b11, code & 1
    mag = np.where(exp == 0, man * 0.5, 2.0 ** (exp - 1.0) * (1 + man / 2))
    return sign * mag


def _decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    values = _e2m1(codes) * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_checkpoint_loads_like_its_dense_twin(tmp_path):
    """Random MXFP4 experts; the dense twin holds the same values in transformers' layout."""
    dense_dir = make_tiny_checkpoint(
        "gpt_oss", tmp_path / "dense", seed=3, hidden_size=64, intermediate_size=32
    )
    tensors = load_file(dense_dir / "model.safetensors")
    quant = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    rng = np.random.default_rng(0)
    config = json.loads((dense_dir / "config.json").read_text())
    e, h, i = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        src = f"model.layers.{layer}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 127, (e, rows, cols // 32), dtype=np.uint8)
            quant[f"{src}{proj}_blocks"] = torch.from_numpy(blocks)
            quant[f"{src}{proj}_scales"] = torch.from_numpy(scales)
            dense = torch.from_numpy(_decode(blocks, scales)).float()  # [E, rows, cols]
            tensors[f"{src}{proj}"] = dense.transpose(1, 2).contiguous()
    save_file(tensors, dense_dir / "model.safetensors")
    quant_dir = tmp_path / "mxfp4"
    quant_dir.mkdir()
    save_file(quant, quant_dir / "model.safetensors")
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quant_dir / "config.json").write_text(json.dumps(config))

    cpu = torch.device("cpu")
    dense_model = load_model(str(dense_dir), device=cpu, dtype="float32").model
    quant_model = load_model(str(quant_dir), device=cpu, dtype="float32").model
    quant_params = dict(quant_model.named_parameters())
    for name, param in dense_model.named_parameters():
        assert torch.equal(param, quant_params[name]), name
