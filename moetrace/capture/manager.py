"""Host-side routing rows, kept per KV slot, and the snapshots that outlive blocks.

``RoutedExpertsManager`` mirrors the KV cache: one row per slot.  A token's
row lives where its KV lives, so a prefix-cache hit finds the rows of the
request that computed the block, for free.  Each row carries the epoch its
block had when the step was scheduled; a row whose epoch differs from the
block's current one belongs to an earlier owner and is never returned.

``RoutedExpertsCache`` snapshots a request's rows before its blocks are freed
(finish, abort, preemption).  On finish, the snapshot taken first wins for the
rows it holds — those are the rows that produced the tokens — and later rows
(recomputed after a preemption) fill in the rest.

Gate weights, when captured, are kept beside the ids under the same slots,
epochs and snapshot rules: a request's weights are always those of its ids.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from moetrace.capture.types import RoutedExpertsLists


class RequestBlocks(Protocol):
    """What a snapshot reads of a request: its id, its blocks and how far it has computed.

    The engine's request satisfies it; capture never imports the engine above it.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...


class StaleRoutingError(RuntimeError):
    """A row that should exist is missing or stale: a bug, never written to a trace."""


class RoutingRows(NamedTuple):
    """A request's routing rows in token order, and their gate weights when captured."""

    ids: np.ndarray  # [rows, num_moe_layers, top_k]
    weights: np.ndarray | None  # same shape, or None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def head(self, n: int) -> RoutingRows:
        return RoutingRows(self.ids[:n], None if self.weights is None else self.weights[:n])

    def extended_by(self, later: RoutingRows) -> RoutingRows:
        """These rows, then ``later``'s rows past them."""
        n = len(self)
        ids = np.concatenate([self.ids, later.ids[n:]])
        if self.weights is None:
            return RoutingRows(ids, None)
        return RoutingRows(ids, np.concatenate([self.weights, later.weights[n:]]))


class RoutedExpertsManager:
    def __init__(
        self,
        num_slots: int,
        num_moe_layers: int,
        top_k: int,
        dtype: np.dtype,
        block_size: int,
        block_epochs: np.ndarray,
        weights_dtype: np.dtype | None = None,
    ) -> None:
        shape = (num_slots, num_moe_layers, top_k)
        self.rows = np.zeros(shape, dtype=dtype)
        self.weights = None if weights_dtype is None else np.zeros(shape, dtype=weights_dtype)
        self.row_epochs = np.zeros(num_slots, dtype=np.int64)  # 0: never written
        self.block_size = block_size
        self.block_epochs = block_epochs  # shared with the block manager, updated in place

    def store_batch(self, lists: RoutedExpertsLists) -> None:
        lists.wait()
        self.rows[lists.slots] = lists.routing
        if self.weights is not None:
            if lists.weights is None:
                raise StaleRoutingError("a step's routing rows came without their gate weights")
            self.weights[lists.slots] = lists.weights
        self.row_epochs[lists.slots] = lists.slot_epochs
        lists.release()

    def gather(self, block_table: list[int], num_rows: int) -> tuple[RoutingRows, int]:
        """Rows of the first ``num_rows`` tokens and how many of them, from the start, are fresh."""
        if num_rows == 0:
            return self.rows_at(np.zeros(0, dtype=np.int64)), 0
        blocks = np.asarray(block_table, dtype=np.int64)
        positions = np.arange(num_rows)
        block_of = blocks[positions // self.block_size]
        slots = block_of * self.block_size + positions % self.block_size
        fresh = self.row_epochs[slots] == self.block_epochs[block_of]
        num_fresh = num_rows if fresh.all() else int(np.argmin(fresh))
        return self.rows_at(slots), num_fresh

    def rows_at(self, slots: np.ndarray) -> RoutingRows:
        """Copies of the rows (and weights) held at ``slots``."""
        return RoutingRows(self.rows[slots], None if self.weights is None else self.weights[slots])


class RoutedExpertsCache:
    def __init__(self, manager: RoutedExpertsManager) -> None:
        self.manager = manager
        self._snapshots: dict[str, RoutingRows] = {}

    def capture(self, request: RequestBlocks) -> None:
        """Save the request's computed rows; call before its blocks are freed."""
        num_rows = min(
            request.num_computed_tokens, len(request.block_table) * self.manager.block_size
        )
        rows, num_fresh = self.manager.gather(request.block_table, num_rows)
        rows = rows.head(num_fresh)
        held = self._snapshots.get(request.request_id)
        if held is not None and len(held) >= len(rows):
            return
        if held is not None:
            rows = held.extended_by(rows)
        self._snapshots[request.request_id] = rows

    def take(self, request: RequestBlocks, num_rows: int | None = None) -> RoutingRows:
        """The request's final rows (all it has when ``num_rows`` is None).

        The request must have been captured after its last step; fewer valid
        rows than ``num_rows`` is a bug and raises rather than write a wrong trace.
        """
        rows = self._snapshots.pop(request.request_id, None)
        if rows is None:
            rows = self.manager.rows_at(np.zeros(0, dtype=np.int64))
        if num_rows is None:
            return rows
        if len(rows) < num_rows:
            raise StaleRoutingError(
                f"request {request.request_id!r}: {len(rows)} valid routing rows, expected {num_rows}"
            )
        return rows.head(num_rows)
