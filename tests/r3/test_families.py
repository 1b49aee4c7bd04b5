"""The replayed gate weights are differentiable as the family's formula (float64 gradcheck)."""

from __future__ import annotations

import pytest
import torch
from support.hf_reference import FAMILIES, build_tiny_model, hooked_routers

import moetrace.r3
from moetrace.r3.families import FAMILIES as RULES

# Families whose transformers routers keep a float64 model's logits in float64; DeepSeek's
# and GraniteMoE's compute them in float32 whatever the model's dtype, so a finite difference
# of the whole model in float64 is not theirs to pass (their rule is checked alone below).
FLOAT64_ROUTERS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "phimoe"]


def _routers(model) -> list:
    with torch.no_grad(), hooked_routers(model) as calls:
        model(input_ids=torch.tensor([[5, 6]]))
    return calls


def _distinct_ids(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed))
    return scores.argsort(dim=-1)[:, :top_k]


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_weights_gradcheck_against_the_router_logits(family):
    model = build_tiny_model(family, seed=21)
    call = _routers(model)[0]
    experts, top_k = call.logits.shape[1], call.indices.shape[1]
    gen = torch.Generator().manual_seed(22)
    logits = (torch.randn(6, experts, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ids = _distinct_ids(6, experts, top_k, seed=23)
    rule = RULES[family].weights
    assert torch.autograd.gradcheck(lambda x: rule(call.router, x, ids), (logits,))


@pytest.mark.parametrize("moe_layer", [0, -1], ids=["first", "last"])
@pytest.mark.parametrize("family", FLOAT64_ROUTERS)
def test_whole_model_gradcheck_through_the_replayed_weights(family, moe_layer):
    """d(MoE block output)/d(its router's weight) in a replaying float64 model, along three
    random directions, by autograd and by finite differences.  Read at the block: past it,
    transformers' norms and eager attention round to float32 whatever the model's dtype."""
    model = build_tiny_model(family, seed=24, dtype=torch.float64)
    model.set_experts_implementation("eager")  # grouped_mm takes no float64
    input_ids = torch.tensor([[7, 8, 9, 10, 11]])
    calls = _routers(model)
    experts, top_k = calls[0].logits.shape[1], calls[0].indices.shape[1]
    given = torch.stack(
        [_distinct_ids(5, experts, top_k, seed=25 + i) for i in range(len(calls))], dim=1
    )[None]
    router = calls[moe_layer].router
    router_name = next(name for name, m in model.named_modules() if m is router)
    block = model.get_submodule(router_name.rsplit(".", 1)[0])
    gen = torch.Generator().manual_seed(26)
    directions = torch.randn(3, *router.weight.shape, generator=gen, dtype=torch.float64)
    project = torch.randn(5 * model.config.hidden_size, 2, generator=gen, dtype=torch.float64)

    def block_output_along(delta: torch.Tensor) -> torch.Tensor:
        seen = []
        hook = block.register_forward_hook(lambda m, a, out: seen.append(out))
        moved = router.weight.detach() + torch.einsum("d,d...->...", delta, directions)
        try:
            with moetrace.r3.replay_routing(model, given):
                torch.func.functional_call(
                    model, {f"{router_name}.weight": moved}, kwargs={"input_ids": input_ids}
                )
        finally:
            hook.remove()
        out = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
        return out.reshape(-1) @ project

    delta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(block_output_along, (delta,))
