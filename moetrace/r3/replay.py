"""``replay_routing``: a transformers MoE model routes by given expert ids (R3's trainer side).

Inside the block, every forward of the model routes each token that has a
row through that row's experts, in the row's order, with weights from the
model's own router over them (the family's rule, ``families.py``), so the
gradient reaches the router through those weights as in Megatron's
``RouterReplay``.  Tokens without a row route as the model would.

Three hooks do it, none of which changes a module: the model's forward
pre-hook reads where the batch's sequences lie and places the rows; each
router's forward hook swaps its ids and weights; each experts module's
forward pre-hook checks that the experts got exactly those, so a
transformers release whose MoE blocks feed their experts otherwise is
refused rather than silently not replayed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moetrace.errors import MoetraceError
from moetrace.r3.layouts import BatchGeometry, GivenRouting, place
from moetrace.r3.model_routers import (
    TESTED_TRANSFORMERS,
    ModelRouters,
    RouterOutput,
    find_routers,
    hooked,
    transformers_version,
)


class _Replay:
    """The rows of the forward in progress and what each layer's experts must receive."""

    def __init__(self, model: nn.Module, routers: ModelRouters, given: GivenRouting) -> None:
        self.model = model
        self.routers = routers
        self.given = given
        self.ids: torch.Tensor | None = None  # [N, moe_layers, top_k]
        self.replayed: torch.Tensor | None = None  # [N] bool
        self.handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.in_forward = False
        self.forwards_with_grad = 0
        self.recomputed = 0  # router calls after their forward: gradient checkpointing's

    def on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and int(getattr(cache, "get_seq_length", lambda: 0)()) > 0:
            raise MoetraceError(
                "replay_routing: a forward over a KV cache (as in generate) runs only the new "
                "tokens; replay whole sequences, one forward each"
            )
        ids, replayed = place(self.given, BatchGeometry.from_forward(args, kwargs))
        self.ids, self.replayed = torch.from_numpy(ids), torch.from_numpy(replayed)
        self.handed.clear()
        self.in_forward = True
        if torch.is_grad_enabled() and self.model.training:
            self.forwards_with_grad += 1

    def on_forward_end(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        self.in_forward = False

    def on_router(self, moe_index: int, router: nn.Module, args: tuple, output: object):
        if self.ids is None:
            raise MoetraceError(
                "replay_routing: a router ran outside a forward of the model given to "
                "replay_routing (call that model, not a part of it)"
            )
        if not self.in_forward:
            self.recomputed += 1
        out = RouterOutput.read(router, output, self.routers.shape)
        logits, own_ids, own_weights = out.get("logits"), out.get("ids"), out.get("weights")
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] != self.ids.shape[0]:
            raise MoetraceError(
                f"replay_routing: MoE layer {self.routers.layers[moe_index].index} routed "
                f"{logits.shape[0]} tokens, the forward's batch has {self.ids.shape[0]} "
                "(the model runs its tokens in one forward to replay them)"
            )
        flat_ids = own_ids.reshape(-1, own_ids.shape[-1])
        if self.ids.device != flat_ids.device:  # once per forward: the rows go where it runs
            self.ids, self.replayed = (
                self.ids.to(flat_ids.device),
                self.replayed.to(flat_ids.device),
            )
        given = self.ids[:, moe_index].to(flat_ids.dtype)
        keep = self.replayed[:, None]
        ids = torch.where(keep, given, flat_ids)
        weights = self.routers.family.weights(router, logits, ids)
        if logits.dtype != torch.float64:  # the dtype the family hands its experts
            weights = weights.to(own_weights.dtype)
        weights = torch.where(keep, weights, own_weights.reshape(weights.shape).to(weights.dtype))
        ids, weights = ids.reshape(own_ids.shape), weights.reshape(own_weights.shape)
        self.handed[moe_index] = (ids, weights)
        return out.replaced(weights, ids)

    def on_experts(self, moe_index: int, experts: nn.Module, args: tuple, kwargs: dict) -> None:
        ids, weights = self.handed.pop(moe_index, (None, None))
        given = [*args, *kwargs.values()]
        if ids is None or not any(a is ids for a in given) or not any(a is weights for a in given):
            raise MoetraceError(
                f"transformers {transformers_version()}: the experts of MoE layer "
                f"{self.routers.layers[moe_index].index} did not receive the ids and weights "
                f"their router returned; moetrace.r3 knows the MoE blocks of transformers "
                f"{TESTED_TRANSFORMERS}"
            )

    def check_recomputed(self) -> None:
        """Refuse a training forward whose layers gradient checkpointing recomputes later,
        after the block (each layer runs once more in the backward of each such forward)."""
        if not self.routers.checkpointing():
            return
        if self.recomputed < self.forwards_with_grad * len(self.routers.layers):
            raise MoetraceError(
                "replay_routing: with gradient checkpointing the MoE layers run again during "
                "backward; call loss.backward() inside the replay_routing block"
            )


@contextmanager
def replay_routing(
    model: nn.Module, routed_experts: object, *, layout: str = "auto"
) -> Iterator[None]:
    """Route every forward of ``model`` inside the block by ``routed_experts``.

    ``routed_experts``: one ``(batch, tokens, layers, top_k)`` array for the
    whole batch, or a list with one ``(rows, layers, top_k)`` array (or trace
    request) per sequence, placed by the forward's ``attention_mask``,
    ``position_ids`` (packed) or ``cu_seq_lens_q``; ``layers`` is the model's
    MoE layers or, vLLM's layout, all its hidden layers (``layout`` says which
    when "auto" cannot).  See docs/r3.md.
    """
    routers = find_routers(model)
    replay = _Replay(model, routers, GivenRouting.from_user(routed_experts, routers.shape, layout))
    with hooked(model, routers, replay):
        yield
        replay.check_recomputed()
