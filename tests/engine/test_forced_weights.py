"""Each family's ``weights_for`` (forced routing) gives its own selection's weights exactly.

Forced routing weighs recorded ids by the family's rule; for the ids the router
itself picks, that rule must reproduce the router's weights bit for bit, or a
replay forcing the experts a model would pick anyway would not reproduce it.
Whether the rule equals transformers' for other ids is tests/runs/test_replay.py's.
"""

from __future__ import annotations

import pytest
import torch
from support.hf_reference import FAMILIES, make_tiny_checkpoint

from moetrace.models.loader import load_model


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_for_the_selected_ids_are_the_selections_weights(tmp_path, family):
    ckpt = make_tiny_checkpoint(family, tmp_path / family, seed=13)
    model = load_model(str(ckpt), device=torch.device("cpu"), dtype="float32").model
    gen = torch.Generator().manual_seed(2)
    for block in model.moe_blocks():
        logits = torch.randn(64, model.num_experts, generator=gen) * 3
        weights, ids = block.select(logits)
        torch.testing.assert_close(block.weights_for(logits, ids), weights, rtol=0, atol=0)
        if family == "phimoe":  # the sparsemixer weighs a first and a second pick differently
            continue
        forced = torch.roll(ids, 1, dims=1)  # the same ids in another order: weights follow
        again = block.weights_for(logits, forced)
        torch.testing.assert_close(torch.roll(again, -1, dims=1), weights, rtol=1e-6, atol=0)
