"""Tests of the transformers-side reference harness (tests/support/hf_reference.py) itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from support.hf_reference import (
    FAMILIES,
    build_tiny_model,
    capture_router_calls,
    descending_ids,
    load_reference_model,
    make_tiny_checkpoint,
    reference_greedy,
    reference_routing,
    selection_scores,
    topk_is_sorted,
)

TOKENS = [int(t) for t in np.random.default_rng(1234).integers(3, 300, size=32)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One float32 checkpoint per family, shared by the tests of this module."""
    root = tmp_path_factory.mktemp("hf_ref")
    return {f: make_tiny_checkpoint(f, root / f, seed=7) for f in FAMILIES}


@pytest.fixture(scope="module")
def routings(checkpoints: dict[str, Path]) -> dict[str, dict]:
    return {f: reference_routing(d, TOKENS) for f, d in checkpoints.items()}


def _num_experts_and_top_k(config: transformers.PretrainedConfig) -> tuple[int, int]:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return int(getattr(config, name)), int(config.num_experts_per_tok)
    raise AssertionError(f"no expert count in {type(config).__name__}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_reloads_identically(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    out = make_tiny_checkpoint(family, tmp_path, seed=3, dtype=dtype)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    built = build_tiny_model(family, seed=3, dtype=dtype).state_dict()
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=dtype, output_loading_info=True
    )
    assert not any(info.values()), info
    loaded = reloaded.state_dict()
    assert sorted(loaded) == sorted(built)
    for name, tensor in built.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_seed_decides_weights() -> None:
    a = build_tiny_model("qwen3_moe", seed=1).state_dict()
    b = build_tiny_model("qwen3_moe", seed=1).state_dict()
    c = build_tiny_model("qwen3_moe", seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.gate.weight"], c["model.layers.0.mlp.gate.weight"])


def test_router_weights_are_not_transformers_zero_init() -> None:
    model = build_tiny_model("qwen3_moe", seed=0)
    for layer in model.model.layers:
        weight = layer.mlp.gate.weight
        assert weight.abs().min() > 0 and weight.std() > 0.2


def test_qwen3_moe_hooked_ids_match_float64_recompute(checkpoints: dict[str, Path]) -> None:
    ckpt = checkpoints["qwen3_moe"]
    config = json.loads((ckpt / "config.json").read_text())
    weights = load_file(ckpt / "model.safetensors")
    calls = capture_router_calls(load_reference_model(ckpt), TOKENS)
    routing = reference_routing(ckpt, TOKENS)
    assert [c.layer_idx for c in calls] == routing["moe_layer_indices"]
    for slot, call in enumerate(calls):
        gate = weights[f"model.layers.{call.layer_idx}.mlp.gate.weight"].double()
        logits = call.inputs.double() @ gate.T
        torch.testing.assert_close(call.logits.double(), logits, rtol=1e-5, atol=1e-5)
        probs = torch.softmax(logits, dim=-1)
        expected = torch.topk(probs, config["num_experts_per_tok"], dim=-1).indices
        assert torch.equal(call.indices, expected), call.layer_idx
        np.testing.assert_array_equal(routing["topk_ids"][:, slot, :], expected.numpy())


def _config(checkpoints: dict[str, Path], family: str) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(checkpoints[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_are_distinct_in_range_and_shaped(
    family: str, checkpoints: dict[str, Path], routings: dict[str, dict]
) -> None:
    num_experts, top_k = _num_experts_and_top_k(_config(checkpoints, family))
    ids = routings[family]["topk_ids"]
    assert ids.dtype == np.int64
    assert ids.shape == (len(TOKENS), len(routings[family]["moe_layer_indices"]), top_k)
    assert ids.min() >= 0 and ids.max() < num_experts
    rows = ids.reshape(-1, top_k)
    assert all(len(set(row.tolist())) == top_k for row in rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_not_degenerate(
    family: str, checkpoints: dict[str, Path], routings: dict[str, dict]
) -> None:
    num_experts, _ = _num_experts_and_top_k(_config(checkpoints, family))
    ids = routings[family]["topk_ids"]
    for slot in range(ids.shape[1]):
        layer = ids[:, slot, :]
        assert len(np.unique(layer)) >= num_experts / 2, (family, slot)
        # Tokens disagree on their expert sets, not just on the order.
        assert len({tuple(sorted(r)) for r in layer.tolist()}) >= len(TOKENS) / 4, (family, slot)


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_in_descending_score_order(
    family: str, checkpoints: dict[str, Path], routings: dict[str, dict]
) -> None:
    model = load_reference_model(checkpoints[family])
    for slot, call in enumerate(capture_router_calls(model, TOKENS)):
        ordered = descending_ids(call)
        np.testing.assert_array_equal(routings[family]["topk_ids"][:, slot], ordered.numpy())
        scores = selection_scores(call)
        chosen = scores.gather(1, ordered)
        assert (chosen[:, :-1] >= chosen[:, 1:]).all()
        if family != "deepseek_v3":
            # A global top-k: nothing left out scores above the weakest chosen expert
            # (DeepSeek-V3's group limit may leave out a higher-scoring expert).
            rest = scores.scatter(1, ordered, float("-inf")).max(dim=1).values
            assert (rest <= chosen[:, -1]).all()
        if topk_is_sorted(family):
            assert torch.equal(ordered, call.indices)


def _qwen_moe_layers(layers: int, step: int, mlp_only: list[int]) -> list[int]:
    # Qwen2/3-MoE DecoderLayer: MoE iff not in mlp_only_layers and (idx + 1) % step == 0.
    return [i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize(
    ("layers", "step", "mlp_only"),
    [(4, 1, []), (4, 1, [1]), (4, 2, []), (4, 2, [1]), (4, 2, [3]), (4, 3, [0])],
)
def test_qwen_moe_layer_indices(
    family: str, layers: int, step: int, mlp_only: list[int], tmp_path: Path
) -> None:
    ckpt = make_tiny_checkpoint(
        family,
        tmp_path,
        seed=11,
        num_hidden_layers=layers,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
    )
    routing = reference_routing(ckpt, TOKENS[:6])
    expected = _qwen_moe_layers(layers, step, mlp_only)
    assert routing["moe_layer_indices"] == expected
    assert routing["topk_ids"].shape == (6, len(expected), 2)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("first_dense", [0, 1, 3])
def test_deepseek_moe_layer_indices(family: str, first_dense: int, tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(
        family, tmp_path, seed=5, num_hidden_layers=4, first_k_dense_replace=first_dense
    )
    routing = reference_routing(ckpt, TOKENS[:6])
    # DeepseekV2/V3 DecoderLayer: MoE iff layer_idx >= first_k_dense_replace.
    assert routing["moe_layer_indices"] == list(range(first_dense, 4))


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss", "granitemoe", "phimoe"])
def test_all_layers_moe_families(
    family: str, checkpoints: dict[str, Path], routings: dict[str, dict]
) -> None:
    config = _config(checkpoints, family)
    assert routings[family]["moe_layer_indices"] == list(range(config.num_hidden_layers))


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_style_config_loads_the_same(
    family: str, tmp_path: Path, checkpoints: dict[str, Path], routings: dict[str, dict]
) -> None:
    hub = make_tiny_checkpoint(family, tmp_path, seed=7, config_style="hub")
    raw = json.loads((hub / "config.json").read_text())
    assert "rope_parameters" not in raw and "rope_theta" in raw and "torch_dtype" in raw
    if family == "qwen3_moe":
        assert "num_experts" in raw and "num_local_experts" not in raw
    a = transformers.AutoConfig.from_pretrained(checkpoints[family]).to_dict()
    b = transformers.AutoConfig.from_pretrained(hub).to_dict()
    a.pop("_name_or_path", None)
    b.pop("_name_or_path", None)
    assert a == b
    np.testing.assert_array_equal(
        reference_routing(hub, TOKENS)["topk_ids"], routings[family]["topk_ids"]
    )


@torch.no_grad()
def _naive_greedy(ckpt: Path, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by full re-forwards (no cache), independent of generate()."""
    model = load_reference_model(ckpt)
    ids = list(prompt)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_reference_greedy_matches_naive_and_ignores_eos(family: str, tmp_path: Path) -> None:
    prompt, steps = TOKENS[:5], 8
    naive = _naive_greedy(make_tiny_checkpoint(family, tmp_path / "a", seed=9), prompt, steps)
    # Same weights, but the second generated token is declared EOS: generation must go on.
    ckpt = make_tiny_checkpoint(family, tmp_path / "b", seed=9, eos_token_id=naive[1])
    assert reference_greedy(ckpt, prompt, steps) == naive
