"""router_replay_indices fed to Megatron-LM's own RouterReplay and top-k routing (megatron-core,
CPU): the packed tokens replay the sequences' rows, and Megatron's replayed gate weights are
the families' rules moetrace.r3 applies."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import moetrace.r3
from moetrace.errors import MoetraceError
from moetrace.r3.families import FAMILIES

with warnings.catch_warnings():  # no Transformer Engine or Apex on the CPU: it says so
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

EXPERTS, TOP_K, LAYERS = 16, 4, 3


@pytest.fixture
def replays():
    RouterReplay.clear_global_router_replay_instances()
    instances = [RouterReplay() for _ in range(LAYERS)]
    yield instances
    RouterReplay.clear_global_router_replay_instances()


def sequences(lengths: list[int], seed: int) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [
        np.argsort(gen.random((n, LAYERS, EXPERTS)), axis=-1)[..., :TOP_K].astype(np.uint8)
        for n in lengths
    ]


def replayed(replay: RouterReplay, logits: torch.Tensor, **routing) -> tuple:
    """(probs [tokens, top_k] at the replayed ids, ids) from Megatron's own routing function."""
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, routing_map = topk_routing_with_score_function(
        logits, TOP_K, router_replay=replay, **routing
    )
    ids = replay.target_topk_idx
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, ids, True))
    return probs.gather(1, ids), ids


@pytest.mark.parametrize("pad_to_multiple", [1, 4])
def test_packed_tokens_replay_each_sequences_rows(replays, pad_to_multiple):
    rows = sequences([5, 8, 2], seed=1)  # engines' rows: tokens - 1 each
    per_layer = moetrace.r3.router_replay_indices(rows, pad_to_multiple=pad_to_multiple)
    RouterReplay.set_replay_data(per_layer)
    tokens = [len(r) + 1 for r in rows]
    padded = [-(-n // pad_to_multiple) * pad_to_multiple for n in tokens]
    starts = np.cumsum([0, *padded])
    logits = torch.randn(starts[-1], EXPERTS)
    for layer, replay in enumerate(replays):
        _, ids = replayed(replay, logits, score_function="softmax")
        for seq, start, size in zip(rows, starts[:-1], padded, strict=True):
            assert torch.equal(
                ids[start : start + len(seq)], torch.from_numpy(seq[:, layer]).long()
            )
            # The last token's row and the padding repeat the sequence's last row.
            tail = ids[start + len(seq) : start + size]
            assert len(tail) >= 1 and (tail == torch.from_numpy(seq[-1, layer]).long()).all()


def test_vllm_layout_keeps_the_moe_layers():
    rows = sequences([4], seed=2)[0]
    vllm = np.zeros((4, LAYERS + 1, TOP_K), dtype=np.uint8)
    vllm[:, 1:] = rows  # layer 0 dense
    got = moetrace.r3.router_replay_indices([vllm], moe_layer_indices=[1, 2, 3])
    want = moetrace.r3.router_replay_indices([rows])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Router(torch.nn.Module):
    """The attributes a family's rule reads from transformers' router."""

    def __init__(self, **attrs) -> None:
        super().__init__()
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    "family, router, routing",
    [
        # Qwen3-MoE in Megatron: top-k on the logits, then softmax over the k.
        ("qwen3_moe", {"norm_topk_prob": True}, {"score_function": "softmax"}),
        # DeepSeek-V2: softmax over every expert first, scaled, never renormalised.
        (
            "deepseek_v2",
            {"routed_scaling_factor": 2.5},
            {"score_function": "softmax", "use_pre_softmax": True, "scaling_factor": 2.5},
        ),
        # DeepSeek-V3: sigmoid, the correction bias only selects, renormalised, scaled.
        (
            "deepseek_v3",
            {"norm_topk_prob": True, "routed_scaling_factor": 2.5},
            {
                "score_function": "sigmoid",
                "expert_bias": torch.randn(EXPERTS),
                "scaling_factor": 2.5,
            },
        ),
    ],
)
def test_megatrons_replayed_weights_are_the_familys_rule(replays, family, router, routing):
    rows = sequences([9], seed=3)
    RouterReplay.set_replay_data(moetrace.r3.router_replay_indices(rows, num_tokens=[9]))
    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(4))
    probs, ids = replayed(replays[0], logits, **routing)
    ours = FAMILIES[family].weights(_Router(**router), logits, ids)
    torch.testing.assert_close(probs, ours)


def test_refusals():
    rows = sequences([3], seed=5)
    with pytest.raises(MoetraceError, match="2 rows for 4 tokens|3 rows for 5 tokens"):
        moetrace.r3.router_replay_indices(rows, num_tokens=[5])
    with pytest.raises(MoetraceError, match="negative"):
        moetrace.r3.router_replay_indices([rows[0].astype(np.int64) - 20])
    with pytest.raises(MoetraceError, match="pad_to_multiple"):
        moetrace.r3.router_replay_indices(rows, pad_to_multiple=0)
