"""What every model family provides to the engine.

A family module builds an ``MoEForCausalLM`` from the checkpoint's config
dict, names its MoE layers, and maps checkpoint tensor names onto its own
parameters (``load_weight``).  Everything else — KV caches, capture, sampling —
is the engine's.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moetrace.capture.capturer import RoutingCapturer
from moetrace.layers.attention import PagedAttention
from moetrace.layers.forced_routing import ForcedRouting


class MoEBlockBase(nn.Module):
    """What every routed MLP shares: routing (its own, or forced) and the capture hook.

    A family's block says how its router picks (``select``) and how it weighs
    given ids (``weights_for``); ``route`` applies forced routing on top.
    """

    moe_index: int = -1
    capturer: RoutingCapturer | None = None
    forced_routing: ForcedRouting | None = None

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) the family's router picks from its logits, ids in router order."""
        raise NotImplementedError

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights the family's rule gives ``ids`` (``select``'s own, for its own ids)."""
        raise NotImplementedError

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``select``, with the forced tokens' ids and weights replaced when routing is forced."""
        weights, ids = self.select(logits)
        forced = self.forced_routing
        if forced is not None and forced.active:
            weights, ids = forced.apply(
                self.moe_index, weights, ids, lambda given: self.weights_for(logits, given)
            )
        return weights, ids

    def record(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Capture the ids and the weights the experts' outputs are multiplied by.

        ``weights`` must be the very tensor the experts then get.  Where the
        fused-MoE kernel will run on them, it writes both itself.
        """
        if self.capturer is None:
            return
        experts = getattr(self, "experts", None)
        if self.capturer.in_kernel and getattr(experts, "use_triton", False):
            n = ids.shape[0]
            experts.capture_with(
                ids,
                self.capturer.destination(self.moe_index, n),
                weights,
                self.capturer.weights_destination(self.moe_index, n),
            )
        else:
            self.capturer.record(self.moe_index, ids, weights)


class MoEForCausalLM(nn.Module):
    architecture: str = ""
    num_experts: int
    top_k: int
    moe_layer_indices: list[int]
    vocab_size: int
    max_model_len: int
    hf_config: dict | None = None  # the checkpoint's config.json, as built from

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor into place; False if the name is not ours."""
        raise NotImplementedError

    def expected_weight_names(self) -> set[str]:
        """Every checkpoint tensor name the model needs."""
        raise NotImplementedError

    def attention_layers(self) -> Iterator[PagedAttention]:
        return (m for m in self.modules() if isinstance(m, PagedAttention))

    def moe_blocks(self) -> list[MoEBlockBase]:
        return [m for m in self.modules() if isinstance(m, MoEBlockBase)]

    def set_capturer(self, capturer: RoutingCapturer | None) -> None:
        for block in self.moe_blocks():
            block.capturer = capturer

    def set_forced_routing(self, forced: ForcedRouting | None) -> None:
        for block in self.moe_blocks():
            block.forced_routing = forced
