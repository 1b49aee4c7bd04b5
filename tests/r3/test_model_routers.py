"""Models and transformers releases whose MoE modules moetrace.r3 does not know are refused."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers
from support.hf_reference import build_tiny_model
from torch import nn

import moetrace.r3
from moetrace.errors import MoetraceError
from moetrace.r3.model_routers import TESTED_TRANSFORMERS, supported_version


def routing(model, length: int = 4) -> torch.Tensor:
    with torch.no_grad(), moetrace.r3.record_routing(model) as rec:
        model(input_ids=torch.arange(3, 3 + length)[None])
    return torch.from_numpy(rec.routed_experts.astype("int64"))


def test_a_dense_model_is_not_a_family_it_knows():
    config = transformers.Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    dense = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(MoetraceError, match=r"model type 'qwen2' is not one .* known: deepseek_v2"):
        moetrace.r3.replay_routing(dense, torch.zeros(1, 2, 2, 2)).__enter__()


def test_transformers_4_is_refused_naming_the_tested_releases():
    with pytest.raises(MoetraceError, match=f"transformers 4.57.1: .* {TESTED_TRANSFORMERS}"):
        supported_version("4.57.1")
    assert supported_version(transformers.__version__) == transformers.__version__


def test_without_transformers_it_says_what_to_install(monkeypatch):
    model = build_tiny_model("olmoe", seed=61)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MoetraceError, match=r"pip install 'moetrace\[r3\]'"):
        moetrace.r3.record_routing(model).__enter__()


def test_routers_of_another_shape_are_refused():
    """As transformers 4.x built them: the router a plain Linear, routing inside the block."""
    model = build_tiny_model("mixtral", seed=62)
    for layer in model.model.layers:
        layer.mlp.gate = nn.Linear(32, 8, bias=False)
    with pytest.raises(MoetraceError, match=f"no MixtralTopKRouter at .* {TESTED_TRANSFORMERS}"):
        moetrace.r3.replay_routing(model, torch.zeros(1, 2, 3, 2)).__enter__()


def test_a_block_that_does_not_feed_its_experts_the_routers_ids_is_refused():
    model = build_tiny_model("qwen3_moe", seed=63)
    given = routing(model)
    block = model.model.layers[1].mlp

    def forward(hidden):  # copies the ids before the experts see them
        flat = hidden.reshape(-1, hidden.shape[-1])
        _, weights, ids = block.gate(flat)
        return block.experts(flat, ids.clone(), weights).reshape(hidden.shape)

    block.forward = forward
    with (
        torch.no_grad(),
        moetrace.r3.replay_routing(model, given),
        pytest.raises(MoetraceError, match="the experts of MoE layer 1 did not receive"),
    ):
        model(input_ids=torch.arange(3, 7)[None])


def test_a_wrapper_is_seen_through():
    model = build_tiny_model("granitemoe", seed=64)

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    given = torch.flip(routing(model), dims=[-1])
    input_ids = torch.arange(3, 7)[None]
    with torch.no_grad():
        with moetrace.r3.replay_routing(model, given):
            direct = model(input_ids=input_ids).logits
        wrapper = Wrapper(model)
        with moetrace.r3.replay_routing(wrapper, given):
            wrapped = wrapper(input_ids=input_ids).logits
    assert torch.equal(direct, wrapped)
