"""Models and transformers releases whose MoE modules moetrace.r3 does not know are refused."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import transformers
from support.hf_reference import build_tiny_model
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

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


@pytest.fixture
def gloo(tmp_path):
    """A one-process gloo group: DDP and FSDP2 wrap a model on the CPU."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_ddp_and_fsdp2_models_replay_as_the_bare_model(gloo):
    given = torch.flip(routing(build_tiny_model("qwen3_moe", seed=65), length=6), dims=[-1])
    input_ids = torch.arange(3, 9)[None]

    def replayed_step(model, wrapped) -> tuple[torch.Tensor, torch.Tensor]:
        with moetrace.r3.replay_routing(wrapped, given):
            logits = wrapped(input_ids=input_ids, labels=input_ids).logits
            logits.sum().backward()
        grad = model.model.layers[2].mlp.gate.weight.grad
        return logits.detach(), getattr(grad, "full_tensor", lambda: grad)()

    bare = build_tiny_model("qwen3_moe", seed=65)
    want = replayed_step(bare, bare)
    ddp_model = build_tiny_model("qwen3_moe", seed=65)
    got_ddp = replayed_step(ddp_model, DistributedDataParallel(ddp_model))
    fsdp_model = build_tiny_model("qwen3_moe", seed=65)
    for layer in fsdp_model.model.layers:
        fully_shard(layer)
    got_fsdp = replayed_step(fsdp_model, fully_shard(fsdp_model))
    for got in (got_ddp, got_fsdp):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1])
