"""Expert load for balancers (EPLB), and replicated experts placed by balanced packing.

The load of an MoE layer is how many token-expert assignments each expert
got: the ``[num_moe_layers, num_experts]`` matrix DeepSeek's EPLB
(``rebalance_experts(weight, num_replicas, ...)``) takes as ``weight``.
``export --format eplb`` writes it, whole or per window of tokens (in the
trace's record order: the order requests finished, the closest a trace has
to time).

``inspect --ep-size N --redundant-experts R`` models what EPLB's idea does
to a layer: ``E + R`` physical expert slots, ``(E + R) / N`` on each rank;
the ``R`` extra replicas go one at a time to the expert with the most load
per replica; then the replicas, each carrying an equal share of its expert's
load, are packed onto the ranks heaviest first, each onto the lightest rank
that still has a free slot.  The load is the one measured on the same rows,
so the result is the best this placement could do on them (a placement
planned on one trace and used on another does worse).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.analysis.load import RowBlock
from moetrace.errors import MoetraceError
from moetrace.trace.stats import counts_from_rows

LOAD_FORMAT = "moetrace-eplb-load"


class WindowedLoad:
    """Assignments per (layer, expert), over all selected rows and per window of them."""

    def __init__(self, num_layers: int, num_experts: int, window_rows: int | None = None) -> None:
        if window_rows is not None and window_rows < 1:
            raise MoetraceError(f"--window-tokens must be at least 1, got {window_rows}")
        self.num_experts = num_experts
        self.window_rows = window_rows
        self.total = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.windows: list[np.ndarray] = []  # per window, (L, E)
        self.window_requests: list[list[int]] = []  # first and last record of each window
        self.rows = 0  # selected rows folded so far

    def update(self, block: RowBlock) -> None:
        self.total += counts_from_rows(block.rows, self.num_experts)
        if self.window_rows is None:
            return
        start = 0
        while start < len(block):
            if self.rows % self.window_rows == 0:
                self.windows.append(np.zeros_like(self.total))
                self.window_requests.append([int(block.request[start])] * 2)
            take = min(self.window_rows - self.rows % self.window_rows, len(block) - start)
            self.windows[-1] += counts_from_rows(block.rows[start : start + take], self.num_experts)
            self.window_requests[-1][1] = int(block.request[start + take - 1])
            self.rows += take
            start += take

    def result(self) -> dict:
        return {"weight": self.total.tolist()}

    def stacked(self) -> np.ndarray:
        """``[L, E]`` without windows, ``[W, L, E]`` with them."""
        if self.window_rows is None:
            return self.total
        return np.stack(self.windows) if self.windows else self.total[None, :, :0]


def load_document(load: WindowedLoad, trace_metadata: dict, source: str, part: str) -> dict:
    """The JSON form of an exported load matrix (docs/analysis.md, "export --format eplb")."""
    doc = {
        "format": LOAD_FORMAT,
        "trace": source,
        "model": trace_metadata.get("model"),
        "architecture": trace_metadata.get("architecture"),
        "moe_layer_indices": [int(x) for x in trace_metadata.get("moe_layer_indices", [])],
        "num_moe_layers": int(load.total.shape[0]),
        "num_logical_experts": int(load.total.shape[1]),
        "top_k": int(trace_metadata.get("top_k", 0)),
        "part": part,
        "unit": "token-expert assignments",
        "weight": load.total.tolist(),
    }
    if load.window_rows is not None:
        w = load.window_rows
        doc["window_tokens"] = w
        doc["windows"] = [
            {
                "tokens": [i * w, min((i + 1) * w, load.rows)],  # of the selected rows, in order
                "records": records,  # the first and last record the window has rows of
                "weight": counts.tolist(),
            }
            for i, (counts, records) in enumerate(
                zip(load.windows, load.window_requests, strict=True)
            )
        ]
    return doc


# -- replicated experts, placed by balanced packing --------------------------------------


def replicate_experts(load: np.ndarray, num_physical: int) -> np.ndarray:
    """Replicas per expert (``[E]``, sum ``num_physical``): each extra one goes to the expert
    with the most load per replica (the lowest id among equals)."""
    experts = load.shape[0]
    if num_physical < experts:
        raise ValueError(f"{num_physical} physical slots cannot hold {experts} experts")
    replicas = np.ones(experts, dtype=np.int64)
    load = load.astype(np.float64)
    for _ in range(num_physical - experts):
        replicas[int(np.argmax(load / replicas))] += 1
    return replicas


def balanced_packing(weights: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack of each item (``[n]``; ``n / num_packs`` items a pack): heaviest item first, each
    onto the lightest pack with room (the lowest pack among equals)."""
    n = weights.shape[0]
    if n % num_packs:
        raise ValueError(f"{n} items do not divide into {num_packs} equal packs")
    capacity = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    pack_load = np.zeros(num_packs, dtype=np.float64)
    pack_size = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-weights, kind="stable"):
        open_packs = np.flatnonzero(pack_size < capacity)
        pack = int(open_packs[np.argmin(pack_load[open_packs])])
        pack_of[item] = pack
        pack_load[pack] += weights[item]
        pack_size[pack] += 1
    return pack_of


@dataclass
class ReplicatedPlacement:
    """One layer's physical slots: which expert each holds and the rank it sits on."""

    physical_to_logical: np.ndarray  # [P]: slots in rank order, (E + R) / N per rank
    replicas: np.ndarray  # [E]: slots per expert
    rank_load: np.ndarray  # [N]: assignments each rank serves, replicas sharing evenly


def place_replicated(load: np.ndarray, ep_size: int, redundant: int) -> ReplicatedPlacement:
    """Replicate and pack one layer's ``[E]`` load over ``ep_size`` ranks."""
    experts = load.shape[0]
    replicas = replicate_experts(load, experts + redundant)
    expert_of_replica = np.repeat(np.arange(experts), replicas)
    share = load[expert_of_replica] / replicas[expert_of_replica]
    rank_of_replica = balanced_packing(share, ep_size)
    order = np.lexsort((expert_of_replica, rank_of_replica))  # by rank, then by expert
    rank_load = np.bincount(rank_of_replica, weights=share, minlength=ep_size)
    return ReplicatedPlacement(expert_of_replica[order], replicas, rank_load)


def check_replication(num_experts: int, ep_size: int | None, redundant: int) -> None:
    """Refuse a replica count the placement cannot honour, naming the options."""
    if redundant < 0:
        raise MoetraceError(f"--redundant-experts must be >= 0, got {redundant}")
    if not ep_size:
        raise MoetraceError("--redundant-experts needs --ep-size N (the ranks to place them on)")
    if (num_experts + redundant) % ep_size:
        raise MoetraceError(
            f"{num_experts} experts + {redundant} redundant do not divide over {ep_size} ranks: "
            "every rank holds the same number of expert slots (EPLB's rule)"
        )


def replicated_report(
    counts: np.ndarray, before: np.ndarray, ep_size: int, redundant: int, layers: list[int]
) -> dict:
    """Per layer: the rank loads after replication and packing, beside those before.

    ``counts``: ``[L, E]`` assignments; ``before``: ``[L, N]`` rank loads of the placement
    the view was given (no replicas).
    """
    per_layer, physical, replicas = [], [], []
    for i, layer in enumerate(layers):
        placed = place_replicated(counts[i], ep_size, redundant)
        physical.append(placed.physical_to_logical.tolist())
        replicas.append(placed.replicas.tolist())
        per_layer.append(
            {
                "layer": int(layer),
                "rank_load": placed.rank_load.tolist(),
                "max_over_mean_before": _ratio(before[i]),
                "max_over_mean": _ratio(placed.rank_load),
                "max_violation_before": _violation(before[i]),
                "max_violation": _violation(placed.rank_load),
                "replicated": {int(e): int(n) for e, n in enumerate(placed.replicas) if n > 1},
            }
        )
    return {
        "redundant_experts": redundant,
        "physical_experts": int(counts.shape[1]) + redundant,
        "slots_per_rank": (int(counts.shape[1]) + redundant) // ep_size,
        "layers": per_layer,
        "physical_to_logical": physical,
        "logical_replicas": replicas,
    }


def _ratio(load: np.ndarray) -> float | None:
    mean = float(load.sum()) / len(load)
    return float(load.max()) / mean if mean else None


def _violation(load: np.ndarray) -> float | None:
    ratio = _ratio(load)
    return None if ratio is None else ratio - 1
