"""MXFP4 test checkpoints for gpt-oss, decoded by an independent numpy decoder.

Nothing here imports moetrace: the values a test expects come from the bit
fields of the e2m1 and e8m0 formats as the OCP spec defines them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from support.hf_reference import make_tiny_checkpoint


def e2m1_values(code: np.ndarray) -> np.ndarray:
    """Independent decoder from the bit fields: sign, 2-bit exponent (bias 1), 1-bit mantissa."""
    sign = np.where(code & 0b1000, -1.0, 1.0)
    exp, man = (code >> 1) & 0b11, code & 1
    mag = np.where(exp == 0, man * 0.5, 2.0 ** (exp - 1.0) * (1 + man / 2))
    return sign * mag


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    values = e2m1_values(codes) * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def mxfp4_twins(tmp_path: Path, **shape) -> tuple[Path, Path]:
    """(dense checkpoint, MXFP4 checkpoint) holding the same random expert values.

    The dense one is in transformers' layout; the MXFP4 one as published
    checkpoints store experts (blocks and scales, gate/up rows interleaved).
    """
    shape = {"hidden_size": 64, "intermediate_size": 32, **shape}
    dense_dir = make_tiny_checkpoint("gpt_oss", tmp_path / "dense", seed=3, **shape)
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
            dense = torch.from_numpy(decode_mxfp4(blocks, scales)).float()  # [E, rows, cols]
            tensors[f"{src}{proj}"] = dense.transpose(1, 2).contiguous()
    save_file(tensors, dense_dir / "model.safetensors")
    quant_dir = tmp_path / "mxfp4"
    quant_dir.mkdir()
    save_file(quant, quant_dir / "model.safetensors")
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quant_dir / "config.json").write_text(json.dumps(config))
    return dense_dir, quant_dir
