"""The built-in ``demo`` model: Qwen3-MoE-shaped, seeded random weights, byte tokenizer.

It lets ``moetrace record demo ...`` run with nothing downloaded.  Layer 0 is
dense (``mlp_only_layers``), so the demo also shows that dense layers get no
routing rows.
"""

from __future__ import annotations

import torch

from moetrace.models.loader import (
    LoadedModel,
    config_digest,
    fill_dummy,
    instantiate,
    resolve_dtype,
)

DEMO_SEED = 1234

DEMO_CONFIG: dict = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 260,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


def load_demo(*, device: torch.device, dtype: str = "auto") -> LoadedModel:
    torch_dtype = resolve_dtype(dtype, DEMO_CONFIG, device)
    if dtype == "auto":
        torch_dtype = torch.float32
    # Filled on the CPU so the demo's weights are the same on every device.
    model = instantiate(DEMO_CONFIG, "demo", torch_dtype, torch.device("cpu"))
    fill_dummy(model, DEMO_SEED, std=0.2)
    model = model.to(device)
    return LoadedModel(
        model, dict(DEMO_CONFIG), "demo", None, torch_dtype, config_digest(DEMO_CONFIG)
    )
