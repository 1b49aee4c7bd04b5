"""``record_routing``: the experts a transformers MoE model routes to, to diff with a rollout.

The trainer's routing of the rollout's tokens, in the trace's terms (one
row per token and MoE layer, ids in router order, highest score first), so
that ``write_trace`` and ``moetrace diff`` measure how far it is from the
routing the rollout engine recorded: R3's router mismatch, before replay.
The ids are read where the experts receive them, so inside
``replay_routing`` (in either nesting) the replayed ones are recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from moetrace.errors import MoetraceError
from moetrace.r3.layouts import BatchGeometry, split_sequences
from moetrace.r3.model_routers import (
    TESTED_TRANSFORMERS,
    ModelRouters,
    RouterOutput,
    find_routers,
    hooked,
    transformers_version,
)
from moetrace.trace.metadata import expert_id_dtype


class RoutingRecord:
    """Each forward's routing while ``record_routing`` was open, in the order they ran."""

    def __init__(self, routers: ModelRouters) -> None:
        self.routers = routers
        self.shape = routers.shape
        self._forwards: list[tuple[BatchGeometry, list[torch.Tensor | None]]] = []
        self._logits: dict[int, tuple[nn.Module, torch.Tensor]] = {}

    def on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        geometry = BatchGeometry.from_forward(args, kwargs)
        self._forwards.append((geometry, [None] * len(self.routers.layers)))

    def on_forward_end(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        pass

    def on_router(self, moe_index: int, router: nn.Module, args: tuple, output: object) -> None:
        if not self._forwards:
            raise MoetraceError(
                "record_routing: a router ran outside a forward of the model given to "
                "record_routing (call that model, not a part of it)"
            )
        logits = RouterOutput.read(router, output, self.shape).get("logits").detach()
        self._logits[moe_index] = (router, logits.reshape(-1, logits.shape[-1]))

    def on_experts(self, moe_index: int, experts: nn.Module, args: tuple, kwargs: dict) -> None:
        """The ids the experts get: the router's, or whatever replaced them (a replay)."""
        given = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        ints = [a for a in given if not a.is_floating_point()]
        if len(ints) != 1 or moe_index not in self._logits:
            raise MoetraceError(
                f"transformers {transformers_version()}: the experts of MoE layer "
                f"{self.routers.layers[moe_index].index} were not called with their router's "
                f"ids; moetrace.r3 knows the MoE blocks of transformers {TESTED_TRANSFORMERS}"
            )
        router, logits = self._logits.pop(moe_index)
        ids = ints[0].detach().reshape(logits.shape[0], -1)
        score = self.routers.family.unsorted_by
        if score is not None:  # router order: highest selection score first, ties kept
            picked = score(router, logits).gather(1, ids)
            ids = ids.gather(1, picked.argsort(dim=1, descending=True, stable=True))
        self._forwards[-1][1][moe_index] = ids

    def _rows(self, forward: int) -> np.ndarray:
        geometry, layers = self._forwards[forward]
        if any(ids is None for ids in layers):
            raise MoetraceError("record_routing: a forward did not run every MoE layer")
        rows = torch.stack(layers, dim=1).cpu().numpy()  # [B*T, moe_layers, top_k]
        return rows.astype(expert_id_dtype(self.shape.num_experts))

    @property
    def num_forwards(self) -> int:
        return len(self._forwards)

    @property
    def routed_experts(self) -> np.ndarray:
        """The last forward's routing, ``(batch, tokens, moe_layers, top_k)``, padding included."""
        if not self._forwards:
            raise MoetraceError("record_routing: no forward ran inside the block")
        geometry, rows = self._forwards[-1][0], self._rows(-1)
        return rows.reshape(geometry.batch, geometry.length, *rows.shape[1:])

    def sequences(self) -> list[np.ndarray]:
        """Every forward's sequences in order, each ``(tokens, moe_layers, top_k)``: one row
        per token (padding left out), split as ``replay_routing`` places them."""
        return [
            seq
            for i, (geometry, _) in enumerate(self._forwards)
            for seq in split_sequences(self._rows(i), geometry)
        ]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Record the routing of every forward of ``model`` inside the block (nothing changes it)."""
    routers = find_routers(model)
    record = RoutingRecord(routers)
    with hooked(model, routers, record):
        yield record
