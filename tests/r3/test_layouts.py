"""Routing that does not fit the model or the batch is refused with one line saying why."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.hf_reference import build_tiny_model

import moetrace.r3
from moetrace.errors import MoetraceError

# The tiny Qwen3-MoE: 3 layers, all MoE, 8 experts, top-2.
LAYERS, EXPERTS, TOP_K = 3, 8, 2


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("qwen3_moe", seed=51)


def routing(batch: int, length: int, seed: int = 0) -> np.ndarray:
    scores = np.random.default_rng(seed).random((batch, length, LAYERS, EXPERTS))
    return np.argsort(scores, axis=-1)[..., :TOP_K]


def forward(model, routed, **kwargs) -> None:
    kwargs.setdefault("input_ids", torch.randint(3, 290, (2, 5)))
    with torch.no_grad(), moetrace.r3.replay_routing(model, routed):
        model(**kwargs)


@pytest.mark.parametrize(
    "routed, message",
    [
        (routing(2, 5)[..., :1], r"does not end in top_k = 2"),
        (routing(2, 5)[:, :, :2], r"2 layers, but the model has 3 MoE layers of 3"),
        (routing(2, 5) + EXPERTS, r"expert id \d+ at \[.*\] is out of range for a model of 8"),
        (np.repeat(routing(2, 5)[..., :1], 2, axis=-1), r"row \[0, 0\] chooses an expert twice"),
        (routing(2, 5)[0], r"expected \(batch, tokens, layers, top_k\) or a list"),
        (routing(2, 5).astype(np.float32), r"must be integers"),
        ([routing(1, 5)[0, :, :, :1]], r"routed_experts\[0\]: shape .* top_k = 2"),
        ([], r"empty list"),
    ],
    ids=["top-k", "layers", "expert-id", "twice", "ndim", "float", "sequence-top-k", "empty"],
)
def test_routing_that_does_not_fit_the_model(model, routed, message):
    with pytest.raises(MoetraceError, match=message):
        forward(model, routed)


def test_a_row_partly_missing_is_refused(model):
    routed = routing(2, 5)
    routed[1, 2, 0, 0] = -1
    with pytest.raises(MoetraceError, match=r"row \[1, 2\] is partly negative"):
        forward(model, routed)


def test_routing_that_does_not_fit_the_batch(model):
    with pytest.raises(MoetraceError, match=r"covers a 2x4 batch, the forward ran 2x5"):
        forward(model, routing(2, 4))
    seqs = list(routing(3, 4))
    with pytest.raises(MoetraceError, match=r"has 3 sequences, the batch holds 2"):
        forward(model, seqs)
    seqs = [routing(1, 2)[0], routing(1, 4)[0]]
    with pytest.raises(MoetraceError, match=r"routed_experts\[0\] has 2 rows, .* 5 tokens"):
        forward(model, seqs)
    with pytest.raises(MoetraceError, match=r"attention_mask of shape"):
        forward(model, list(routing(2, 4)), attention_mask=torch.ones(2, 1, 5, 5))


def test_a_cached_forward_cannot_replay(model):
    routed = list(routing(1, 4))
    with (
        torch.no_grad(),
        moetrace.r3.replay_routing(model, routed),
        pytest.raises(MoetraceError, match=r"a forward over a KV cache \(as in generate\)"),
    ):
        model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=2, do_sample=False)


def test_a_router_called_on_its_own_is_refused(model):
    layer = model.model.layers[0]
    with (
        torch.no_grad(),
        moetrace.r3.replay_routing(model, routing(1, 5)),
        pytest.raises(MoetraceError, match="call that model, not a part of it"),
    ):
        layer.mlp(torch.randn(1, 5, model.config.hidden_size))


def test_hooks_are_gone_after_the_block_even_after_an_error(model):
    input_ids = torch.randint(3, 290, (2, 5))
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        with pytest.raises(MoetraceError):
            forward(model, routing(2, 4), input_ids=input_ids)
        assert torch.equal(model(input_ids=input_ids).logits, plain)


def test_batch_routing_lays_rows_on_a_trl_shaped_batch(model):
    """Prompts padded on the left, completions on the right, as TRL's GRPO batches are."""
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    input_ids = torch.randint(3, 290, mask.shape) * mask
    lengths = mask.sum(dim=1).tolist()  # 4 and 6 tokens
    seqs = [routing(1, n - 1, seed=n)[0] for n in lengths]  # the engines' rows: one fewer
    laid = moetrace.r3.batch_routing(seqs, input_ids, attention_mask=mask)
    assert laid.shape == (2, 6, LAYERS, TOP_K)
    for b, rows in enumerate(seqs):
        at = torch.nonzero(mask[b]).flatten()
        assert torch.equal(laid[b, at[:-1]], torch.from_numpy(rows))
        assert (laid[b, at[-1]] == -1).all() and (laid[b][mask[b] == 0] == -1).all()
    seen = []
    for routed, order in ((laid, [0, 1]), (seqs, [0, 1]), (laid[[1, 0]], [1, 0])):
        kwargs = dict(input_ids=input_ids[order], attention_mask=mask[order])
        with (
            torch.no_grad(),
            moetrace.r3.record_routing(model) as rec,
            moetrace.r3.replay_routing(model, routed),
        ):
            model(**kwargs)
        seen.append(rec.routed_experts[np.argsort(order)])
    np.testing.assert_array_equal(seen[0], seen[1])
    np.testing.assert_array_equal(seen[0], seen[2])  # rows travel with their sequence
