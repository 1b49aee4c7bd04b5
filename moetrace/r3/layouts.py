"""Routed experts as users hold them, checked and put on the model's MoE layers.

Two shapes come in (docs/r3.md, "Layouts"):

- one array for the whole batch, ``(B, T, layers, top_k)``, row ``[b, t]`` for
  the token at ``input_ids[b, t]``;
- one array per sequence, ``(rows, layers, top_k)``, as a trace's request or an
  engine's HTTP answer holds it: ``rows`` is the sequence's token count, or one
  less (the engines return none for the last token, which they never ran).

The layer axis is either the model's MoE layers (moetrace's traces) or every
hidden layer with dense layers' rows zero (vLLM and SGLang).  A row whose ids
are all negative is a row the sender did not have.  Tokens without a row
(that one, the last token of a sequence given one row fewer, padding) route by
the model's own router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moetrace.errors import MoetraceError

LAYOUTS = ("auto", "vllm", "moe")


@dataclass(frozen=True)
class RoutingShape:
    """What a replayed row must fit: the model's layers, experts and top-k."""

    num_hidden_layers: int
    moe_layer_indices: tuple[int, ...]
    num_experts: int
    top_k: int


def _as_array(value: object, where: str) -> np.ndarray:
    """A numpy view of an array-like (tensor, ndarray, a trace request's ``routed_experts``)."""
    value = getattr(value, "routed_experts", value)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise MoetraceError(f"{where}: expert ids must be integers, got dtype {array.dtype}")
    return array


def moe_layers_only(
    rows: np.ndarray, shape: RoutingShape, *, layout: str = "auto", where: str = "routed_experts"
) -> np.ndarray:
    """``rows`` (..., layers, top_k) with its layer axis cut to the MoE layers.

    ``layout="vllm"``: every hidden layer, dense ones zero; ``"moe"``: MoE layers
    only; ``"auto"`` tells them apart by the axis length (they coincide when
    every layer routes).
    """
    if layout not in LAYOUTS:
        raise MoetraceError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if rows.ndim < 2 or rows.shape[-1] != shape.top_k:
        raise MoetraceError(
            f"{where}: shape {tuple(rows.shape)} does not end in top_k = {shape.top_k} "
            "(the model's num_experts_per_tok)"
        )
    num_layers = rows.shape[-2]
    num_moe, num_hidden = len(shape.moe_layer_indices), shape.num_hidden_layers
    if layout == "auto":
        layout = "moe" if num_layers == num_moe else "vllm" if num_layers == num_hidden else ""
    wanted = num_moe if layout == "moe" else num_hidden
    if num_layers != wanted:
        raise MoetraceError(
            f"{where}: {num_layers} layers, but the model has {num_moe} MoE layers of "
            f"{num_hidden} (moetrace's layout has one per MoE layer, vLLM's one per hidden layer)"
        )
    if layout == "moe" or num_moe == num_hidden:
        return rows
    dense = [i for i in range(num_hidden) if i not in shape.moe_layer_indices]
    present = ~(rows < 0).all(axis=(-2, -1))  # rows that are there (a missing row is all -1)
    if np.any(rows[present][..., dense, :] != 0):
        raise MoetraceError(
            f"{where}: dense layer(s) {dense} hold expert ids (vLLM's layout leaves them zero): "
            "routing of another model?"
        )
    return rows[..., list(shape.moe_layer_indices), :]


def check_ids(rows: np.ndarray, shape: RoutingShape, where: str) -> np.ndarray:
    """bool (...,): which rows carry ids (all-negative rows carry none); refuses ids out of
    range, a row partly negative and an expert chosen twice in one row."""
    negative = rows < 0
    missing = negative.all(axis=(-2, -1))
    partly = negative.any(axis=(-2, -1)) & ~missing
    if partly.any():
        at = np.argwhere(partly)[0].tolist()
        raise MoetraceError(f"{where}: row {at} is partly negative (a missing row is all -1)")
    too_big = rows >= shape.num_experts
    if too_big.any():
        at = np.argwhere(too_big)[0].tolist()
        raise MoetraceError(
            f"{where}: expert id {int(rows[tuple(at)])} at {at} is out of range for a model "
            f"of {shape.num_experts} experts"
        )
    ordered = np.sort(rows, axis=-1)
    twice = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(axis=-1)
    if twice.any():
        at = np.argwhere(twice)[0].tolist()
        raise MoetraceError(f"{where}: row {at[:-1]} chooses an expert twice in layer {at[-1]}")
    return ~missing


@dataclass
class GivenRouting:
    """Replayed rows, checked: a whole batch's, or one array per sequence."""

    batch: np.ndarray | None  # (B, T, moe_layers, top_k) int64
    sequences: list[np.ndarray] | None  # each (rows, moe_layers, top_k) int64

    @classmethod
    def from_user(cls, value: object, shape: RoutingShape, layout: str = "auto") -> GivenRouting:
        if isinstance(value, (list, tuple)):
            if not value:
                raise MoetraceError("routed_experts: an empty list of sequences")
            seqs = []
            for i, item in enumerate(value):
                where = f"routed_experts[{i}]"
                array = _as_array(item, where)
                if array.ndim != 3:
                    raise MoetraceError(
                        f"{where}: expected (rows, layers, top_k), got shape {array.shape}"
                    )
                array = moe_layers_only(array, shape, layout=layout, where=where)
                check_ids(array, shape, where)
                seqs.append(array.astype(np.int64))
            return cls(None, seqs)
        array = _as_array(value, "routed_experts")
        if array.ndim != 4:
            raise MoetraceError(
                "routed_experts: expected (batch, tokens, layers, top_k) or a list of "
                f"(rows, layers, top_k) arrays, one per sequence; got shape {array.shape}"
            )
        array = moe_layers_only(array, shape, layout=layout)
        check_ids(array, shape, "routed_experts")
        return cls(array.astype(np.int64), None)


@dataclass(frozen=True)
class BatchGeometry:
    """Where a forward's sequences lie: its token grid, padding and packing."""

    batch: int
    length: int
    attention_mask: np.ndarray | None  # bool (B, T): real tokens
    position_ids: np.ndarray | None  # (B, T): a 0 starts a packed sequence
    cu_seqlens: np.ndarray | None  # sequence bounds over the B*T flattened tokens

    @classmethod
    def from_forward(cls, args: tuple, kwargs: dict) -> BatchGeometry:
        """From a ``ForCausalLM`` call's arguments (``input_ids`` or ``inputs_embeds`` give
        the grid; ``attention_mask``, ``position_ids`` and ``cu_seq_lens_q``, as transformers'
        padding-free training passes it, the sequences)."""
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise MoetraceError(
                "replay_routing: the forward got neither input_ids nor inputs_embeds"
            )
        return cls.of(
            (int(tokens.shape[0]), int(tokens.shape[1])),
            attention_mask=kwargs.get("attention_mask"),
            position_ids=kwargs.get("position_ids"),
            cu_seqlens=kwargs.get("cu_seq_lens_q"),
        )

    @classmethod
    def of(
        cls,
        shape: tuple[int, int],
        *,
        attention_mask: object = None,
        position_ids: object = None,
        cu_seqlens: object = None,
    ) -> BatchGeometry:
        """A ``(batch, tokens)`` grid with its padding mask, packed positions or bounds."""
        batch, length = shape
        mask = _host(attention_mask)
        if mask is not None and mask.shape != (batch, length):
            raise MoetraceError(
                f"attention_mask of shape {mask.shape}: a 2-D (batch, tokens) padding mask "
                f"places per-sequence rows, and the batch is {batch}x{length}"
            )
        positions = _host(position_ids)
        if positions is not None:
            positions = np.broadcast_to(positions.reshape(-1, length), (batch, length))
        bounds = _host(cu_seqlens)
        return cls(
            batch,
            length,
            None if mask is None else mask.astype(bool),
            positions,
            None if bounds is None else bounds.astype(np.int64),
        )

    def sequences(self) -> list[np.ndarray]:
        """Flat token positions (into B*T) of each sequence, in order."""
        valid = (
            np.ones((self.batch, self.length), dtype=bool)
            if self.attention_mask is None
            else self.attention_mask
        )
        flat_valid = valid.reshape(-1)
        if self.cu_seqlens is not None:
            return [
                start + np.flatnonzero(flat_valid[start:stop])
                for start, stop in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True)
            ]
        out = []
        for b in range(self.batch):
            pos = np.flatnonzero(valid[b])
            if pos.size == 0:
                continue
            cuts = [0]
            if self.position_ids is not None:
                cuts += [i for i in range(1, pos.size) if self.position_ids[b, pos[i]] == 0]
            for lo, hi in zip(cuts, [*cuts[1:], pos.size], strict=True):
                out.append(b * self.length + pos[lo:hi])
        return out


def _host(value: object) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def place(given: GivenRouting, geometry: BatchGeometry) -> tuple[np.ndarray, np.ndarray]:
    """(ids (B*T, moe_layers, top_k) int64, replayed (B*T,) bool) for one forward."""
    n = geometry.batch * geometry.length
    if given.batch is not None:
        b, t = given.batch.shape[:2]
        if (b, t) != (geometry.batch, geometry.length):
            raise MoetraceError(
                f"routed_experts covers a {b}x{t} batch, the forward ran {geometry.batch}x"
                f"{geometry.length} tokens"
            )
        ids = given.batch.reshape(n, *given.batch.shape[2:])
        replayed = (ids >= 0).all(axis=(1, 2))
        if geometry.attention_mask is not None:
            replayed &= geometry.attention_mask.reshape(-1)
        return ids, replayed
    ids = scatter(given.sequences, geometry, name="routed_experts")
    return ids, (ids >= 0).all(axis=(1, 2))


def scatter(seqs: list[np.ndarray], geometry: BatchGeometry, *, name: str) -> np.ndarray:
    """Per-sequence rows on the batch's flat token grid: ``(B*T, layers, top_k)`` int64, -1
    where a token has no row (padding, a sequence's last token given one row fewer)."""
    spans = geometry.sequences()
    if len(spans) != len(seqs):
        raise MoetraceError(
            f"{name} has {len(seqs)} sequences, the batch holds {len(spans)} "
            "(rows of attention_mask, split where position_ids restart at 0, or cu_seq_lens_q)"
        )
    ids = np.full((geometry.batch * geometry.length, *seqs[0].shape[1:]), -1, dtype=np.int64)
    for i, (rows, span) in enumerate(zip(seqs, spans, strict=True)):
        if rows.shape[0] not in (span.size, span.size - 1):
            raise MoetraceError(
                f"{name}[{i}] has {rows.shape[0]} rows, its sequence in the batch "
                f"{span.size} tokens (want {span.size}, or {span.size - 1} without the last "
                "token's, as the engines return)"
            )
        if rows.shape[1:] != ids.shape[1:]:
            raise MoetraceError(f"{name}[{i}]: shape {rows.shape} unlike the first's")
        ids[span[: rows.shape[0]]] = rows
    return ids


def batch_routing(
    sequences: Sequence[object],
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence rows laid on a batch: ``(B, T, layers, top_k)`` int64 aligned with
    ``input_ids`` (placed as ``replay_routing`` places them), -1 where a token has no row.

    A trainer that splits and shuffles its batch by rows (TRL does) carries this tensor
    beside ``input_ids`` and hands its slice to ``replay_routing``.
    """
    arrays = as_sequences(sequences)
    if not arrays:
        raise MoetraceError("batch_routing: no sequences")
    geometry = BatchGeometry.of(
        (int(input_ids.shape[0]), int(input_ids.shape[1])),
        attention_mask=attention_mask,
        position_ids=position_ids,
    )
    ids = scatter([a.astype(np.int64) for a in arrays], geometry, name="sequences")
    return torch.from_numpy(ids.reshape(geometry.batch, geometry.length, *ids.shape[1:]))


def split_sequences(rows: np.ndarray, geometry: BatchGeometry) -> list[np.ndarray]:
    """Per-token rows (B*T, ...) of one forward, cut into its sequences (padding left out)."""
    return [rows[span] for span in geometry.sequences()]


def as_sequences(value: Sequence[object]) -> list[np.ndarray]:
    """Arrays (or trace requests) as numpy arrays, checked only for being integer arrays."""
    return [_as_array(item, f"sequences[{i}]") for i, item in enumerate(value)]
