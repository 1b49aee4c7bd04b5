"""Forced routing: MoE layers route chosen tokens through given experts (routing replay).

``moetrace replay --force-routing`` runs a trace's tokens with every MoE
layer using the experts the trace recorded, as routing replay does in
training: the ids are the recorded ones, in their order, and the weights are
recomputed from the model's own router scores over that set by the family's
rule (each family's ``weights_for``).  Tokens of a step that are not forced
keep their own routing, so forced and free requests may share a step.

The engine fills the static buffers before a step and turns ``active`` on;
the layers read ``ids[:n, layer]`` for the ``n`` tokens of their input
(padding rows included: they hold some valid id and are never forced).  A
forced step runs eagerly, never inside a captured graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ForcedRouting:
    def __init__(
        self, max_num_tokens: int, num_moe_layers: int, top_k: int, device: torch.device
    ) -> None:
        self.ids = torch.zeros(
            (max_num_tokens, num_moe_layers, top_k), dtype=torch.int32, device=device
        )
        self.mask = torch.zeros(max_num_tokens, dtype=torch.bool, device=device)
        self.active = False  # some token of the current step is forced

    def load(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Force the step's first ``len(mask)`` tokens where ``mask`` is true, to ``ids``."""
        n = mask.shape[0]
        self.mask.zero_()
        self.mask[:n].copy_(mask)
        self.ids[:n].copy_(ids)
        self.active = True

    def clear(self) -> None:
        self.active = False

    def apply(
        self,
        moe_layer: int,
        weights: torch.Tensor,
        ids: torch.Tensor,
        weigh: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) with the forced tokens' replaced; ``weigh(ids)`` weights given ids."""
        n = ids.shape[0]
        forced = self.ids[:n, moe_layer].to(ids.dtype)
        mask = self.mask[:n, None]
        forced_weights = weigh(forced).to(weights.dtype)
        return torch.where(mask, forced_weights, weights), torch.where(mask, forced, ids)
