"""record_routing gives the ids transformers' routers choose, in router order, per sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.hf_reference import FAMILIES, build_tiny_model, descending_ids, hooked_routers

import moetrace.r3
from moetrace.errors import MoetraceError


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_rows_are_the_routers_choice_highest_score_first(family):
    model = build_tiny_model(family, seed=31)
    input_ids = torch.randint(3, 290, (2, 6), generator=torch.Generator().manual_seed(32))
    with torch.no_grad(), hooked_routers(model) as calls, moetrace.r3.record_routing(model) as rec:
        model(input_ids=input_ids)
    want = torch.stack([descending_ids(c) for c in calls], dim=1).reshape(2, 6, len(calls), -1)
    assert rec.routed_experts.shape == want.shape
    np.testing.assert_array_equal(rec.routed_experts, want.numpy())


def test_sequences_leave_padding_out_and_follow_the_forwards():
    model = build_tiny_model("olmoe", seed=33)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    with torch.no_grad(), moetrace.r3.record_routing(model) as rec:
        model(input_ids=torch.tensor([[5, 6, 7, 0], [0, 8, 9, 10]]), attention_mask=mask)
        model(input_ids=torch.tensor([[11, 12]]))
    full = rec.routed_experts  # the last forward's
    seqs = rec.sequences()
    assert rec.num_forwards == 2 and [len(s) for s in seqs] == [3, 3, 2]
    np.testing.assert_array_equal(seqs[2], full[0])


@pytest.mark.parametrize("record_outside", [False, True])
def test_inside_replay_it_records_the_replayed_experts(record_outside):
    model = build_tiny_model("deepseek_v3", seed=34)
    input_ids = torch.randint(3, 290, (1, 5), generator=torch.Generator().manual_seed(35))
    with torch.no_grad(), moetrace.r3.record_routing(model) as own:
        model(input_ids=input_ids)
    given = np.roll(own.routed_experts, 1, axis=-1)  # the same sets, another order
    given[0, 2] = (given[0, 2] + 1) % 16  # and another set for one token
    replay = moetrace.r3.replay_routing(model, given)
    record = moetrace.r3.record_routing(model)
    first, second = (record, replay) if record_outside else (replay, record)
    with torch.no_grad(), first as a, second as b:
        model(input_ids=input_ids)
    rec = a if record_outside else b
    np.testing.assert_array_equal(np.sort(rec.routed_experts, -1), np.sort(given, -1))


def test_without_a_forward_there_is_nothing_to_read():
    model = build_tiny_model("qwen3_moe", seed=36)
    with moetrace.r3.record_routing(model) as rec:
        pass
    with pytest.raises(MoetraceError, match="no forward ran"):
        rec.routed_experts  # noqa: B018
