"""Which rows an analysis sees, streamed in bounded chunks with each row's context.

Every view folds ``RowBlock``s: a slice of routing rows together with, per row,
its request, its token position, the token id that went through the model and
whether it was a prompt token, plus the routing of the token before it in the
same request (for temporal locality).  The whole trace is read with
``Trace.iter_row_chunks``; a request subset is read range by range from the
request table's offsets, so neither path ever holds more than one chunk.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace

PARTS = ("all", "prompt", "output")
DEFAULT_CHUNK_ROWS = 16384  # a few MB of rows even for 61 layers x top-8


@dataclass(frozen=True)
class Selection:
    """Requests, token part and MoE layers an analysis covers."""

    positions: np.ndarray | None = None  # record positions, sorted and unique; None: all
    part: str = "all"  # "all", "prompt" (rows of prompt tokens) or "output"
    columns: np.ndarray | None = None  # routed_experts axis-1 columns; None: every layer

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise MoetraceError(f"part must be one of {', '.join(PARTS)}, got {self.part!r}")


@dataclass
class RowBlock:
    """A chunk of selected rows, each with where it came from."""

    rows: np.ndarray  # (n, L, k) expert ids, router order
    request: np.ndarray  # (n,) record position of the row's request
    position: np.ndarray  # (n,) token position within the request (= row number)
    tokens: np.ndarray  # (n,) id of the token that went through the model
    is_prompt: np.ndarray  # (n,) bool
    prev_rows: np.ndarray  # (n, L, k) routing of the previous token (meaningless without has_prev)
    has_prev: np.ndarray  # (n,) bool: the previous token of the same request has a row

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def subset(self, mask: np.ndarray) -> RowBlock:
        return RowBlock(
            self.rows[mask],
            self.request[mask],
            self.position[mask],
            self.tokens[mask],
            self.is_prompt[mask],
            self.prev_rows[mask],
            self.has_prev[mask],
        )


class Accumulator(Protocol):
    """Folds blocks; ``result`` turns what it gathered into plain, JSON-able figures."""

    def update(self, block: RowBlock) -> None: ...

    def result(self) -> dict | list: ...


# -- choosing what to look at ------------------------------------------------------


def parse_range(text: str, n: int) -> range:
    """``START:STOP`` over record positions, Python slice rules (negatives count from the end)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            i = int(parts[0])
            if not -n <= i < n:
                raise MoetraceError(f"record {i} out of range ({n} requests)")
            i %= n
            return range(i, i + 1)
        if len(parts) == 2:
            start = int(parts[0]) if parts[0].strip() else None
            stop = int(parts[1]) if parts[1].strip() else None
            return range(n)[slice(start, stop)]
    except ValueError:
        pass
    raise MoetraceError(f"bad request range {text!r}: expected START:STOP (record numbers)")


def select_positions(
    trace: Trace, ids: Sequence[str] = (), ranges: Sequence[str] = ()
) -> np.ndarray | None:
    """Record positions of requests named by id (exact, else a glob) or by record range."""
    if not ids and not ranges:
        return None
    table_ids = trace.request_ids
    where: dict[str, list[int]] = {}
    for i, rid in enumerate(table_ids):
        where.setdefault(rid, []).append(i)
    chosen: set[int] = set()
    for rid in ids:
        if rid in where:
            chosen.update(where[rid])
            continue
        matched = [i for i, t in enumerate(table_ids) if fnmatch.fnmatchcase(t, rid)]
        if not matched:
            raise MoetraceError(f"no request with id {rid!r} in {trace.path}")
        chosen.update(matched)
    for text in ranges:
        chosen.update(parse_range(text, trace.num_requests))
    return np.array(sorted(chosen), dtype=np.int64)


def select_columns(trace: Trace, layers: Sequence[int] = ()) -> np.ndarray | None:
    """Columns of the MoE layers named by decoder layer index (as ``moe_layer_indices`` has them)."""
    if not layers:
        return None
    indices = [int(x) for x in trace.metadata["moe_layer_indices"]]
    columns = []
    for layer in layers:
        if layer not in indices:
            raise MoetraceError(
                f"layer {layer} does not route; the MoE layers are {_ranges_text(indices)}"
            )
        columns.append(indices.index(layer))
    return np.array(sorted(set(columns)), dtype=np.int64)


def _ranges_text(values: Sequence[int]) -> str:
    if len(values) <= 8:
        return ", ".join(map(str, values))
    return f"{values[0]}..{values[-1]} ({len(values)} layers)"


def layer_indices(trace: Trace, selection: Selection) -> list[int]:
    """Decoder layer index of each analysed column."""
    indices = [int(x) for x in trace.metadata["moe_layer_indices"]]
    if selection.columns is None:
        return indices
    return [indices[c] for c in selection.columns]


# -- streaming -------------------------------------------------------------------------


@dataclass
class _Table:
    """The request table's offsets as plain int64 arrays (searchable by row)."""

    row_start: np.ndarray
    row_end: np.ndarray
    token_start: np.ndarray
    prompt_len: np.ndarray
    num_rows: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.num_rows = self.row_end - self.row_start


def _table(trace: Trace) -> _Table:
    t = trace.requests
    row_start = t["row_start"].astype(np.int64)
    if len(row_start) > 1 and np.any(np.diff(row_start) < 0):
        raise MoetraceError(
            f"{trace.path}: request records are not in row order (damaged file; see Trace.verify())"
        )
    return _Table(
        row_start=row_start,
        row_end=row_start + t["num_rows"].astype(np.int64),
        token_start=t["token_start"].astype(np.int64),
        prompt_len=t["prompt_len"].astype(np.int64),
    )


class RowStream:
    """The selected rows of a trace as ``RowBlock``s of at most ``chunk_rows`` rows."""

    def __init__(
        self,
        trace: Trace,
        selection: Selection | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        if chunk_rows < 1:
            raise MoetraceError(f"chunk rows must be at least 1, got {chunk_rows}")
        self.trace = trace
        self.selection = selection or Selection()
        self.chunk_rows = chunk_rows
        self._table = _table(trace)

    # -- what the selection holds, from the table alone --------------------------------

    def counts(self) -> dict:
        """Requests and rows selected, by part; reads no rows."""
        t, pos = self._table, self.selection.positions
        n_rows = t.num_rows if pos is None else t.num_rows[pos]
        p_len = t.prompt_len if pos is None else t.prompt_len[pos]
        prompt_rows = int(np.minimum(n_rows, p_len).sum())
        total = int(n_rows.sum())
        return {
            "requests": int(len(n_rows)),
            "rows": {"all": total, "prompt": prompt_rows, "output": total - prompt_rows}[
                self.selection.part
            ],
            "prompt_rows": prompt_rows,
            "output_rows": total - prompt_rows,
        }

    # -- the pass --------------------------------------------------------------------

    def __iter__(self) -> Iterator[RowBlock]:
        positions = self.selection.positions
        ranges = [(0, self.trace.num_rows)] if positions is None else self._ranges(positions)
        carry, at = None, None
        # The reader checks each request's checksum as its rows go by (open_trace verify).
        for start, rows in self.trace.iter_row_ranges(ranges, self.chunk_rows):
            if start != at:
                carry = None  # a range starts at a request's first row: no previous token
            at = start + len(rows)
            block, carry = self._block(start, rows, carry)
            if block is not None:
                yield block

    def _ranges(self, positions: np.ndarray) -> Iterable[tuple[int, int]]:
        """Row ranges of the chosen requests, adjacent ones merged into one read."""
        t = self._table
        lo = hi = None
        for p in positions:
            s, e = int(t.row_start[p]), int(t.row_end[p])
            if s == e:
                continue
            if hi is not None and s == hi:
                hi = e
                continue
            if hi is not None:
                yield lo, hi
            lo, hi = s, e
        if hi is not None:
            yield lo, hi

    def _block(
        self, start: int, rows: np.ndarray, carry: np.ndarray | None
    ) -> tuple[RowBlock | None, np.ndarray | None]:
        n = rows.shape[0]
        if n == 0:
            return None, carry
        t = self._table
        r = start + np.arange(n, dtype=np.int64)
        req = np.searchsorted(t.row_start, r, side="right") - 1
        req_safe = np.maximum(req, 0)
        valid = (req >= 0) & (r < t.row_end[req_safe])
        position = r - t.row_start[req_safe]
        token_index = t.token_start[req_safe] + position
        tokens = np.full(n, -1, dtype=np.int32)
        if valid.any():
            lo, hi = int(token_index[valid].min()), int(token_index[valid].max()) + 1
            tokens[valid] = self.trace.read_tokens(lo, hi)[token_index[valid] - lo]
        prev = np.empty_like(rows)
        prev[1:] = rows[:-1]
        if carry is not None:
            prev[0] = carry
        has_prev = valid & (position > 0)
        if carry is None:
            has_prev[0] = False
        block = RowBlock(
            rows=rows,
            request=req,
            position=position,
            tokens=tokens,
            is_prompt=position < t.prompt_len[req_safe],
            prev_rows=prev,
            has_prev=has_prev,
        )
        next_carry = rows[-1].copy()
        mask = valid
        if self.selection.part == "prompt":
            mask = mask & block.is_prompt
        elif self.selection.part == "output":
            mask = mask & ~block.is_prompt
        if not mask.all():
            block = block.subset(mask)
        if self.selection.columns is not None:
            cols = self.selection.columns
            block = replace(block, rows=block.rows[:, cols], prev_rows=block.prev_rows[:, cols])
        return (block if len(block) else None), next_carry


def run(stream: Iterable[RowBlock], accumulators: Sequence[Accumulator]) -> None:
    """One pass over ``stream`` feeding every accumulator."""
    for block in stream:
        for acc in accumulators:
            acc.update(block)
