"""replay_routing against the definition, every family: transformers' own modules on tiny
float32 models, the experts' inputs read by hooks of the test's own (support/hf_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.hf_reference import (
    FAMILIES,
    build_tiny_model,
    expert_inputs,
    forced_weights,
    hooked_routers,
    split_router_output,
)

import moetrace.r3
from moetrace.errors import MoetraceError

BATCH, LENGTH = 2, 7


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return build_tiny_model(request.param, seed=11)


def tokens(seed: int = 0, batch: int = BATCH, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(3, 290, (batch, length), generator=torch.Generator().manual_seed(seed))


def random_routing(model, batch: int, length: int, seed: int) -> torch.Tensor:
    """Distinct random experts per (token, MoE layer): (batch, length, moe_layers, top_k)."""
    with torch.no_grad(), hooked_routers(model) as calls:
        model(input_ids=tokens(0, 1, 2))
    experts, top_k = calls[0].logits.shape[1], calls[0].indices.shape[1]
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, length, len(calls), experts, generator=gen)
    return scores.argsort(dim=-1)[..., :top_k]


def test_replaying_the_models_own_routing_gives_its_logits_exactly(model):
    input_ids = tokens()
    with torch.no_grad():
        with hooked_routers(model) as calls:
            plain = model(input_ids=input_ids).logits
        own = torch.stack([c.indices for c in calls], dim=1)  # router order, as returned
        with moetrace.r3.replay_routing(model, own.reshape(BATCH, LENGTH, *own.shape[1:])):
            replayed = model(input_ids=input_ids).logits
    assert torch.equal(replayed, plain)


def test_given_experts_reach_every_layers_experts_with_the_familys_weights(model):
    input_ids = tokens(1)
    given = random_routing(model, BATCH, LENGTH, seed=2)
    family = model.config.model_type
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        with (
            moetrace.r3.replay_routing(model, given),
            hooked_routers(model) as routers,
            expert_inputs(model) as experts,
        ):
            replayed = model(input_ids=input_ids).logits
    assert len(experts) == len(routers) == given.shape[2]
    flat = given.reshape(BATCH * LENGTH, *given.shape[2:])
    for moe_index, (router, got) in enumerate(zip(routers, experts, strict=True)):
        assert torch.equal(got.ids.long(), flat[:, moe_index])
        want = forced_weights(family, router.router, router.logits, flat[:, moe_index])
        torch.testing.assert_close(got.weights, want.to(got.weights.dtype))
    assert not torch.allclose(replayed, plain)  # other experts, other logits


def test_the_router_learns_through_the_replayed_weights(model):
    """Gradients reach every router, and equal those of the test's own replay (hooks that
    swap ids and weights by the family's formula), not the gradients of the model's own
    routing."""
    input_ids = tokens(3)
    given = random_routing(model, BATCH, LENGTH, seed=4)
    routers = [c.router for c in _calls(model, input_ids)]

    def router_grads(replay) -> list[torch.Tensor]:
        model.zero_grad()
        with replay:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        return [r.weight.grad.clone() for r in routers]

    ours = router_grads(moetrace.r3.replay_routing(model, given))
    theirs = router_grads(_independent_replay(model, given))
    own = router_grads(torch.enable_grad())
    for a, b, c in zip(ours, theirs, own, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, c)


def _calls(model, input_ids):
    with torch.no_grad(), hooked_routers(model) as calls:
        model(input_ids=input_ids)
    return calls


class _independent_replay:
    """Routing replay written in the test: forward hooks returning the given ids and the
    family's formula (support/hf_reference.forced_weights) over the router's own logits."""

    def __init__(self, model, given: torch.Tensor) -> None:
        self.model, self.flat = model, given.reshape(-1, *given.shape[2:])

    def __enter__(self):
        family = self.model.config.model_type
        self.handles = []
        for moe_index, call in enumerate(_calls(self.model, tokens(0, 1, 2))):

            def hook(module, args, output, moe_index=moe_index):
                logits, ids, weights = split_router_output(module, output)
                new_ids = self.flat[:, moe_index].to(ids.dtype)
                new_weights = forced_weights(family, module, logits, new_ids)
                swap = {id(ids): new_ids, id(weights): new_weights.to(weights.dtype)}
                return tuple(swap.get(id(part), part) for part in output)

            self.handles.append(call.router.register_forward_hook(hook))

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def test_rows_per_sequence_land_on_their_tokens_and_the_last_token_routes_itself():
    """Right- and left-padded rows of (tokens - 1) rows each, as engines return them."""
    model = build_tiny_model("qwen3_moe", seed=5)
    lengths = [5, 7]
    given = random_routing(model, 2, 7, seed=6)
    for left in (False, True):
        mask = torch.zeros(2, 7, dtype=torch.long)
        for b, n in enumerate(lengths):
            mask[b, slice(7 - n, None) if left else slice(None, n)] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids = tokens(7)
        seqs = [given[b, : n - 1] for b, n in enumerate(lengths)]
        kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=positions)
        got, own = replayed_and_own(model, seqs, **kwargs)
        for layer, (mine, theirs) in enumerate(zip(got, own, strict=True)):
            for b, n in enumerate(lengths):
                at = b * 7 + np.flatnonzero(mask[b].numpy())
                assert torch.equal(mine.ids[at[:-1]], given[b, : n - 1, layer])
                assert torch.equal(mine.ids[at[-1]], theirs.indices[at[-1]])  # no row: its own
            pads = np.flatnonzero(mask.numpy().reshape(-1) == 0)
            assert torch.equal(mine.ids[pads], theirs.indices[pads])


def replayed_and_own(model, routed, **kwargs):
    """One replayed forward: what each layer's experts got, and what its router chose by
    itself (hooks registered before the replay's see the router's own output)."""
    with (
        torch.no_grad(),
        hooked_routers(model) as own,
        moetrace.r3.replay_routing(model, routed),
        expert_inputs(model) as got,
    ):
        model(**kwargs)
    return got, own


@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens_q"])
def test_packed_sequences_are_found_by_position_ids_or_cu_seqlens(packing):
    model = build_tiny_model("olmoe", seed=8)
    lengths = [4, 6, 3]
    given = random_routing(model, 1, sum(lengths), seed=9)[0]
    starts = np.cumsum([0, *lengths])
    seqs = [given[a : b - 1] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    input_ids = tokens(10, 1, sum(lengths))
    kwargs: dict = {"input_ids": input_ids}
    if packing == "position_ids":
        kwargs["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    else:
        kwargs["cu_seq_lens_q"] = torch.tensor(starts, dtype=torch.int32)
    got, own = replayed_and_own(model, seqs, **kwargs)
    lasts = starts[1:] - 1
    rows = np.setdiff1d(np.arange(sum(lengths)), lasts)
    for layer, (mine, theirs) in enumerate(zip(got, own, strict=True)):
        assert torch.equal(mine.ids[rows], given[rows, layer])
        assert torch.equal(mine.ids[lasts], theirs.indices[lasts])


@pytest.mark.parametrize(
    "family, config",
    [
        ("deepseek_v2", {}),  # first_k_dense_replace=1: layer 0 is dense
        ("qwen2_moe", {"mlp_only_layers": [1], "num_hidden_layers": 4}),
    ],
)
def test_vllm_layout_every_hidden_layer_dense_ones_zero(family, config):
    model = build_tiny_model(family, seed=12, **config)
    num_hidden = model.config.num_hidden_layers
    given = random_routing(model, BATCH, LENGTH, seed=13)
    moe_layers = [c.layer_idx for c in _calls(model, tokens(0, 1, 2))]
    assert len(moe_layers) < num_hidden
    vllm = torch.zeros(BATCH, LENGTH, num_hidden, given.shape[-1], dtype=torch.long)
    vllm[:, :, moe_layers] = given
    input_ids = tokens(14)
    with torch.no_grad():
        with moetrace.r3.replay_routing(model, given, layout="moe"):
            want = model(input_ids=input_ids).logits
        with moetrace.r3.replay_routing(model, vllm.numpy().astype(np.uint8)):
            got = model(input_ids=input_ids).logits
    assert torch.equal(got, want)
    dense = [i for i in range(num_hidden) if i not in moe_layers][0]
    vllm[0, 0, dense] = 1
    with pytest.raises(MoetraceError, match=r"dense layer\(s\) .* hold expert ids"):
        moetrace.r3.replay_routing(model, vllm).__enter__()


def test_a_row_of_minus_ones_routes_by_the_model():
    model = build_tiny_model("mixtral", seed=15)
    given = random_routing(model, BATCH, LENGTH, seed=16)
    given[1, 3] = -1
    got, own = replayed_and_own(model, given, input_ids=tokens(17))
    missing = 1 * LENGTH + 3
    for layer, (mine, theirs) in enumerate(zip(got, own, strict=True)):
        assert torch.equal(mine.ids[missing], theirs.indices[missing])
        assert torch.equal(mine.ids[0], given[0, 0, layer])


@pytest.mark.parametrize("reentrant", [False, True])
def test_with_gradient_checkpointing_backward_inside_the_block_replays_the_recomputation(
    reentrant,
):
    model = build_tiny_model("qwen3_moe", seed=18)
    given = random_routing(model, BATCH, LENGTH, seed=19)
    input_ids = tokens(20)
    router = _calls(model, input_ids)[0].router

    def grad(checkpointing: bool, backward_inside: bool, **also) -> torch.Tensor:
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
        model.train()
        try:
            with moetrace.r3.replay_routing(model, given):
                if also.get("no_grad_forward_first"):
                    with torch.no_grad():
                        model(input_ids=input_ids)
                loss = model(input_ids=input_ids, labels=input_ids).loss
                if backward_inside:
                    loss.backward()
            if not backward_inside:
                loss.backward()
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
        return router.weight.grad.clone()

    torch.testing.assert_close(grad(True, True), grad(False, False), rtol=0, atol=0)
    with pytest.raises(MoetraceError, match="call loss.backward\\(\\) inside"):
        grad(True, False)
    with pytest.raises(MoetraceError, match="call loss.backward\\(\\) inside"):
        grad(True, False, no_grad_forward_first=True)  # its router calls are no recompute
