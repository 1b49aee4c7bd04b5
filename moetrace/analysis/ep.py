"""Expert-parallel balance: what a routing does to ranks when experts are spread over them.

With expert parallelism each rank holds some experts; a token is sent to every
rank that holds one of its top-k experts (the all-to-all fan-out), and the
busiest rank sets the step time.  The placement is an ``(L, E)`` expert->rank
map: contiguous blocks by default (vLLM's linear placement), round-robin, or
any map read from a file (e.g. an EPLB placement without replicas).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moetrace.analysis.load import RowBlock
from moetrace.errors import MoetraceError

PLACEMENTS = ("contiguous", "round-robin")


def contiguous_map(num_experts: int, ep_size: int) -> np.ndarray:
    """Expert -> rank in blocks; with a remainder the first ranks hold one expert more."""
    base, extra = divmod(num_experts, ep_size)
    sizes = np.full(ep_size, base) + (np.arange(ep_size) < extra)
    return np.repeat(np.arange(ep_size), sizes)


def round_robin_map(num_experts: int, ep_size: int) -> np.ndarray:
    return np.arange(num_experts) % ep_size


def expert_map(
    num_layers: int,
    num_experts: int,
    ep_size: int | None = None,
    placement: str = "contiguous",
    map_file: str | Path | None = None,
) -> np.ndarray:
    """The ``(L, E)`` rank of every expert, from a placement rule or a JSON file."""
    if map_file is not None:
        return _read_map(Path(map_file), num_layers, num_experts, ep_size)
    if ep_size is None or ep_size < 1:
        raise MoetraceError(f"--ep-size must be a positive number of ranks, got {ep_size}")
    if ep_size > num_experts:
        raise MoetraceError(f"--ep-size {ep_size} is more ranks than the {num_experts} experts")
    if placement not in PLACEMENTS:
        raise MoetraceError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    row = (contiguous_map if placement == "contiguous" else round_robin_map)(num_experts, ep_size)
    return np.tile(row, (num_layers, 1))


def _read_map(path: Path, num_layers: int, num_experts: int, ep_size: int | None) -> np.ndarray:
    """A list of E ranks (every layer alike) or a list of L such lists (one per MoE layer)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise MoetraceError(f"cannot read expert map {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise MoetraceError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        ranks = np.asarray(data, dtype=np.int64)
    except (TypeError, ValueError):
        raise MoetraceError(f"{path}: expected a list of ranks or a list of such lists") from None
    if ranks.ndim == 1:
        ranks = np.tile(ranks, (num_layers, 1))
    if ranks.shape != (num_layers, num_experts):
        raise MoetraceError(
            f"{path}: map has shape {list(ranks.shape)}, expected [{num_experts}] "
            f"or [{num_layers}, {num_experts}] (one rank per expert)"
        )
    if ranks.min() < 0:
        raise MoetraceError(f"{path}: negative rank {int(ranks.min())}")
    size = int(ranks.max()) + 1
    if ep_size is not None and size > ep_size:
        raise MoetraceError(f"{path}: rank {size - 1} but --ep-size is {ep_size}")
    return ranks


class EPBalance:
    """Per-rank load and per-token fan-out (distinct ranks among a token's top-k experts)."""

    def __init__(self, expert_to_rank: np.ndarray, ep_size: int | None = None) -> None:
        self.map = np.asarray(expert_to_rank, dtype=np.int64)
        self.ep_size = ep_size or int(self.map.max()) + 1
        num_layers = self.map.shape[0]
        self.rank_load = np.zeros((num_layers, self.ep_size), dtype=np.int64)
        self.fanout = None  # (L, k + 1): tokens by number of distinct ranks, allocated on use
        self.tokens = 0

    def update(self, block: RowBlock) -> None:
        n, num_layers, k = block.rows.shape
        if self.fanout is None:
            self.fanout = np.zeros((num_layers, k + 1), dtype=np.int64)
        self.tokens += n
        r = np.arange(n)[:, None]
        reached = np.zeros((n, self.ep_size), dtype=bool)
        for layer in range(num_layers):
            ranks = self.map[layer][block.rows[:, layer]]  # (n, k)
            self.rank_load[layer] += np.bincount(ranks.ravel(), minlength=self.ep_size)
            reached[:] = False
            reached[r, ranks] = True
            self.fanout[layer] += np.bincount(reached.sum(axis=1), minlength=k + 1)

    def result(self, layers: list[int] | None = None) -> dict:
        layers = layers if layers is not None else list(range(self.rank_load.shape[0]))
        per_layer = []
        for i, layer in enumerate(layers):
            load = self.rank_load[i]
            mean = load.sum() / self.ep_size
            hist = self.fanout[i] if self.fanout is not None else np.zeros(1, dtype=np.int64)
            tokens = int(hist.sum())
            per_layer.append(
                {
                    "layer": int(layer),
                    "rank_load": load.tolist(),
                    "max_over_mean": float(load.max() / mean) if mean else None,
                    "max_violation": float((load.max() - mean) / mean) if mean else None,
                    "busiest_rank": int(np.argmax(load)) if load.sum() else None,
                    "mean_ranks_per_token": (
                        float((np.arange(len(hist)) * hist).sum() / tokens) if tokens else None
                    ),
                    "ranks_per_token_histogram": hist.tolist(),
                }
            )
        k = self.fanout.shape[1] - 1 if self.fanout is not None else None
        return {
            "ep_size": self.ep_size,
            "top_k": k,
            "expert_to_rank": self.map.tolist(),
            "layers": per_layer,
        }
