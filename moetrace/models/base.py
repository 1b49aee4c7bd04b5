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
from moetrace.layers.moe import RoutingRule


class MoEBlockBase(nn.Module):
    """What every routed MLP shares: routing (its own, or forced) and the capture hook.

    A family's block says how its router picks (``select``) and how it weighs
    given ids (``weights_for``); ``route`` applies forced routing on top.
    """

    moe_index: int = -1
    capturer: RoutingCapturer | None = None
    forced_routing: ForcedRouting | None = None
    # ``select`` in the fused routing kernel's terms; None: the family routes through torch.
    routing_rule: RoutingRule | None = None
    # Whether ``forward`` takes ``keep_rows``: its output may then be the experts' rows
    # not yet summed (``layers/residual.ExpertRows``), which the decoder layer's residual
    # add sums (``models/common.py``'s ``feed_forward``).
    can_keep_rows: bool = False
    top_k: int

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

    def route_and_record(
        self,
        logits: torch.Tensor,
        weights_dtype: torch.dtype,
        *,
        upcast: bool = False,
        scaling: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) for the experts, recorded: ``route`` (on float32 logits with
        ``upcast``), times ``scaling`` in float32, cast to ``weights_dtype``.

        On CUDA, for decode-sized steps, the fused routing kernels compute the
        same rule (``routing_rule``) and write the capture themselves; forced
        steps and families without a rule take the torch ops.
        """
        experts = getattr(self, "experts", None)
        forced = self.forced_routing is not None and self.forced_routing.active
        rule = self.routing_rule
        if rule is not None and not forced and experts.can_route_fused(logits.shape[0]):
            capturer, n = self.capturer, logits.shape[0]
            in_kernel = capturer is not None and capturer.in_kernel
            weights, ids = experts.route_fused(
                logits,
                rule,
                self.top_k,
                weights_dtype,
                scaling=scaling,
                capture=capturer.destination(self.moe_index, n) if in_kernel else None,
                capture_weights=(
                    capturer.weights_destination(self.moe_index, n) if in_kernel else None
                ),
            )
            if capturer is not None and not in_kernel:
                capturer.record(self.moe_index, ids, weights)
            return weights, ids
        weights, ids = self.route(logits.float() if upcast else logits)
        if scaling is not None:
            weights = weights * scaling
        weights = weights.to(weights_dtype)
        self.record(ids, weights)
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
