"""The request record of a trace, declared once: its table columns and its flat arrays.

A trace keeps each request as one record of the ``requests`` table plus a
slice of each flat dataset (``routed_experts`` one row per token run through
the model, ``token_ids`` one entry per token), found through the record's
offsets.  The writer's table dtype and rows, the reader's ``TraceRequest``,
the request checksum, merge and the importers are all derived from
``COLUMNS`` and ``ARRAYS`` below.  So:

- a new per-request field is one ``Column`` plus its attribute (with a
  default) on ``FinishedRequest``;
- a new per-row or per-token array is one ``FlatArray`` with ``since`` set to
  the next format version, plus its attribute (default ``None``) on
  ``FinishedRequest`` (format 2 added the gate weights and log-probabilities
  that way).

How such additions keep older files readable and newer files honest towards
older readers is stated in docs/trace-format.md ("Changing the format").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import h5py
import numpy as np

from moetrace.trace.integrity import TOKEN_DTYPE, plain_value
from moetrace.trace.metadata import TraceMetadata

REQUESTS = "requests"
ROUTED_EXPERTS = "routed_experts"
TOKEN_IDS = "token_ids"
ROUTED_WEIGHTS = "routed_weights"
LOGPROBS = "logprobs"

FINISH_REASONS = ("stop", "length", "abort")
FINISH_REASON_DTYPE = h5py.enum_dtype(
    {name: code for code, name in enumerate(FINISH_REASONS)}, basetype="u1"
)
STRING = h5py.string_dtype()


# -- what a request is ---------------------------------------------------------------


@dataclass
class OutputLogprobs:
    """Per output token: the sampled token's log-probability and rank, and the top N.

    What vLLM returns for ``logprobs=N``, from the model's raw distribution
    (before penalties and temperature); rank 1 is the most likely token.
    """

    token_logprob: np.ndarray  # float32 (output_len,)
    token_rank: np.ndarray  # int64 (output_len,)
    top_ids: np.ndarray  # int32 (output_len, N)
    top_logprobs: np.ndarray  # float32 (output_len, N)


@dataclass
class FinishedRequest:
    """One ended request: its tokens and one routing row per token run through the model.

    What the engine hands to the trace writer, and (as ``TraceRequest``) what
    the reader gives back.  ``routed_experts`` has shape ``(num_rows,
    num_moe_layers, top_k)`` in the trace's narrow dtype, rows in token order,
    experts in router order.  A request that finished normally has ``num_rows
    == len(prompt) + len(output) - 1`` (the last sampled token is never run
    through the model); an aborted one has a row for each token it computed.
    """

    request_id: str
    index: int  # position of the request in the input (0-based), stable across resumes
    prompt_token_ids: np.ndarray  # int32 (prompt_len,)
    output_token_ids: np.ndarray  # int32 (output_len,)
    routed_experts: np.ndarray  # (num_rows, num_moe_layers, top_k), narrow unsigned dtype
    finish_reason: str  # one of FINISH_REASONS
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)  # JSON-able, free-form
    sample_index: int = 0  # which of the prompt's n samples (0 unless n > 1)
    # Gate weight of each recorded expert, shaped and ordered as routed_experts (format 2).
    routed_weights: np.ndarray | None = None  # float16 or float32 (num_rows, L, k)
    # Log-probability of each output token under the model that ran it (format 2).
    output_logprobs: np.ndarray | None = None  # float32 (output_len,)
    stop_reason: int | str | None = None  # vLLM's: the stop token id (not EOS) or stop string
    # The settings it was sampled with (vLLM's SamplingParams names; seed: the one it used).
    sampling_params: dict = field(default_factory=dict)
    # Handed out by the engine, not stored in the trace (a reader decodes it from the tokens):
    output_text: str | None = None  # detokenized output cut at a stop string (with stop strings)
    logprobs: OutputLogprobs | None = None  # with SamplingParams.logprobs
    # Teacher-forced (scoring) requests: each prompt token's log-probability, NaN where none.
    prompt_logprobs: np.ndarray | None = None  # float32 (prompt_len,)
    # Seconds from the request's arrival in the engine to its first step, and to its first
    # sampled token (None if it never got one): the server's /metrics.
    queue_s: float | None = None
    first_token_s: float | None = None
    # [version, start, end): the weight version that sampled output tokens start..end-1
    # (moetrace serve; a served trace keeps them in ``extra["weight_versions"]``).
    weight_versions: list = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def output_len(self) -> int:
        return int(self.output_token_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.routed_experts.shape[0])


# -- the request table ---------------------------------------------------------------

FIELD = "field"  # a FinishedRequest attribute, written and read back
LENGTH = "length"  # a length FinishedRequest computes from its arrays (written, not read back)
PLACED = "placed"  # set by the writer where it places the request (offsets, checksum)


def _same(value):
    return value


def storable_text(value: object) -> str:
    """Text HDF5 stores as given: a NUL or a lone surrogate is written as its escape.

    Such an id would make the whole batch of records fail to write; escaped,
    its record is kept and the others with it.
    """
    text = str(value)
    if "\x00" in text or not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return text


def _extra_to_table(extra: dict) -> str:
    return json.dumps(extra, sort_keys=True) if extra else ""


def _extra_from_table(text: str) -> dict:
    return json.loads(text) if text else {}


def _stop_reason_to_table(reason: int | str | None) -> str:
    """JSON text: an integer is a stop token id, a string the stop string; "" for none."""
    return "" if reason is None else json.dumps(reason if isinstance(reason, str) else int(reason))


def _stop_reason_from_table(text: str) -> int | str | None:
    return json.loads(text) if text else None


@dataclass(frozen=True)
class Column:
    """One field of the ``requests`` table.

    ``default`` is the table value a file written before the column existed
    reads as (through ``from_table``); the columns of format version 1 have none
    (every file has them).  ``droppable``: appended to such an older table, a
    record leaves the value out instead of being refused, because it says how
    the request ran, not what it recorded (the file's earlier records lack it
    as well); a value that identifies the request (``sample_index``) is never
    dropped.
    """

    name: str
    dtype: np.dtype
    kind: str = FIELD
    attr: str = ""  # the record attribute, when it is not named like the column
    default: object = None
    to_table: Callable = _same
    from_table: Callable = _same
    droppable: bool = False

    @property
    def default_value(self):
        """The attribute a record of a file without the column gets."""
        return self.from_table(self.default)

    @property
    def attribute(self) -> str:
        return self.attr or self.name


COLUMNS: tuple[Column, ...] = (
    Column("id", STRING, attr="request_id", to_table=storable_text),
    Column("index", np.dtype("<i8"), to_table=int, from_table=int),
    Column("prompt_len", np.dtype("<i4"), LENGTH),
    Column("output_len", np.dtype("<i4"), LENGTH),
    Column("num_rows", np.dtype("<i8"), LENGTH),
    Column("row_start", np.dtype("<i8"), PLACED),
    Column("token_start", np.dtype("<i8"), PLACED),
    # An enum: stored as its code, read back by the names of the file's own enum type.
    Column("finish_reason", FINISH_REASON_DTYPE, to_table=FINISH_REASONS.index),
    Column("num_cached_tokens", np.dtype("<i4"), to_table=int, from_table=int),
    Column("num_preemptions", np.dtype("<i4"), to_table=int, from_table=int),
    Column("checksum", np.dtype("<u4"), PLACED),
    Column("extra", STRING, to_table=_extra_to_table, from_table=_extra_from_table),
    # Several samples of one prompt (n > 1) share its id and differ here; 0 before it existed.
    Column("sample_index", np.dtype("<i4"), to_table=int, from_table=int, default=0),
    # vLLM's stop_reason as JSON text: the stop token id (not EOS) or the stop string matched.
    Column(
        "stop_reason",
        STRING,
        to_table=_stop_reason_to_table,
        from_table=_stop_reason_from_table,
        default="",
        droppable=True,
    ),
    # The request's sampling settings as a JSON object ("" before the column existed).
    Column(
        "sampling_params",
        STRING,
        to_table=_extra_to_table,
        from_table=_extra_from_table,
        default="",
        droppable=True,
    ),
)
REQUEST_DTYPE = np.dtype([(c.name, c.dtype) for c in COLUMNS])


def encode_fields(req: FinishedRequest) -> dict:
    """The request's own table values, encoded (all but the ``PLACED`` columns).

    The writer encodes on the caller's thread, so a field that cannot be stored
    (``extra`` not JSON-able) fails at ``submit`` and a later change to the
    request cannot reach the file.
    """
    return {c.name: c.to_table(getattr(req, c.attribute)) for c in COLUMNS if c.kind != PLACED}


def table_row(
    encoded: dict, placed: dict[str, int], columns: tuple[Column, ...] = COLUMNS
) -> tuple:
    """A record as a tuple in table order, from ``encode_fields`` and the writer's values.

    ``columns``: those of the table written to (an older file's may end earlier).
    """
    return tuple(int(placed[c.name]) if c.kind == PLACED else encoded[c.name] for c in columns)


def unstorable(encoded: dict, columns: tuple[Column, ...]) -> str | None:
    """Why a table with only ``columns`` cannot hold the record (a later field set), or None."""
    for c in COLUMNS[len(columns) :]:
        if encoded[c.name] != c.default and not c.droppable:
            return f"{c.name} {encoded[c.name]!r}: the trace was written before that field existed"
    return None


def table_columns(table_dtype: np.dtype) -> tuple[Column, ...] | None:
    """The columns of an existing table this version can append to, or None.

    A table written before some columns existed holds a leading part of
    ``COLUMNS``; records appended to it leave the later columns out (so they
    must hold those columns' defaults).
    """
    names = table_dtype.names or ()
    columns = COLUMNS[: len(names)]
    if tuple(c.name for c in columns) != names:
        return None
    if any(c.default is None for c in COLUMNS[len(names) :]):
        return None
    return columns


class RecordDecoder:
    """Turns records of one file's table into ``FinishedRequest`` fields.

    Built from the file's table dtype: a column the file lacks reads as its
    default, and an enum column by the names of the file's own enum type.
    """

    def __init__(self, table_dtype: np.dtype, columns: tuple[Column, ...] = COLUMNS) -> None:
        names = table_dtype.names or ()
        lacking = [c.name for c in columns if c.name not in names and c.default is None]
        if lacking:
            raise ValueError(f"the request table lacks field(s) {', '.join(lacking)}")
        self.enum_names: dict[str, dict[int, str]] = {}
        for c in columns:
            enum = h5py.check_enum_dtype(table_dtype[c.name]) if c.name in names else None
            if enum is not None:
                self.enum_names[c.name] = {code: name for name, code in enum.items()}
        self._present = [c for c in columns if c.kind != LENGTH and c.name in names]
        self._missing = [c for c in columns if c.kind != LENGTH and c.name not in names]

    def fields(self, record: np.void) -> dict:
        """Keyword arguments for a ``FinishedRequest`` (``PLACED`` columns included)."""
        out = {c.attribute: c.default_value for c in self._missing}
        for c in self._present:
            value = record[c.name]
            names = self.enum_names.get(c.name)
            out[c.attribute] = names[int(value)] if names else c.from_table(plain_value(value))
        return out


# -- the flat arrays -----------------------------------------------------------------

ROWS = "rows"  # one entry per row: sliced by row_start / num_rows
TOKENS = "tokens"  # one entry per token, prompt then output: sliced by token_start / lengths


@dataclass(frozen=True)
class FlatArray:
    """A flat dataset holding one slice per request, found through the record's offsets.

    Arrays with ``since`` > 1 are optional: a file holds them only when its
    writer was asked to (``written``), a record lacking one has the attribute
    None, and a file that holds one carries at least that format version.
    """

    name: str
    along: str  # ROWS or TOKENS
    dtype: Callable[[TraceMetadata], np.dtype]
    shape: Callable[[TraceMetadata], tuple[int, ...]]  # of one entry
    since: int = 1  # the format version that introduced the array
    written: Callable[[TraceMetadata], bool] = lambda md: True
    join: Callable[[FinishedRequest], np.ndarray] | None = None  # record -> array
    split: Callable[[np.ndarray, int], dict] | None = None  # (array, prompt_len) -> fields

    @property
    def required(self) -> bool:
        return self.since == 1

    def values(self, req: FinishedRequest) -> np.ndarray | None:
        return self.join(req) if self.join else getattr(req, self.name)

    def fields(self, data: np.ndarray, prompt_len: int) -> dict:
        return self.split(data, prompt_len) if self.split else {self.name: data}


def _join_tokens(req: FinishedRequest) -> np.ndarray:
    return np.concatenate([req.prompt_token_ids, req.output_token_ids]).astype(
        TOKEN_DTYPE, copy=False
    )


def _split_tokens(tokens: np.ndarray, prompt_len: int) -> dict:
    return {"prompt_token_ids": tokens[:prompt_len], "output_token_ids": tokens[prompt_len:]}


def _join_logprobs(req: FinishedRequest) -> np.ndarray | None:
    """Laid out as ``token_ids``: NaN for each prompt token, then the output tokens' values."""
    if req.output_logprobs is None:
        return None
    out = np.full(req.prompt_len + len(req.output_logprobs), np.nan, dtype="<f4")
    out[req.prompt_len :] = req.output_logprobs
    return out


def _split_logprobs(values: np.ndarray, prompt_len: int) -> dict:
    return {"output_logprobs": values[prompt_len:]}


# In checksum order: a request's checksum covers its slice of each array the file holds,
# in this order (docs/trace-format.md, "Checksum").
ARRAYS: tuple[FlatArray, ...] = (
    FlatArray(
        ROUTED_EXPERTS,
        ROWS,
        dtype=lambda md: md.expert_dtype.newbyteorder("<"),
        shape=lambda md: (md.num_moe_layers, md.top_k),
    ),
    FlatArray(
        TOKEN_IDS,
        TOKENS,
        dtype=lambda md: TOKEN_DTYPE,
        shape=lambda md: (),
        join=_join_tokens,
        split=_split_tokens,
    ),
    # Format 2: the gate weights beside the ids (``record --record-weights``).
    FlatArray(
        ROUTED_WEIGHTS,
        ROWS,
        dtype=lambda md: np.dtype(md.weights_dtype).newbyteorder("<"),
        shape=lambda md: (md.num_moe_layers, md.top_k),
        since=2,
        written=lambda md: md.weights_dtype is not None,
    ),
    # Format 2: one float32 per token, NaN where none was computed (``record --logprobs``:
    # the prompt tokens).  Per token rather than per output token, so that it is sliced
    # by the offsets every record already has.
    FlatArray(
        LOGPROBS,
        TOKENS,
        dtype=lambda md: np.dtype("<f4"),
        shape=lambda md: (),
        since=2,
        written=lambda md: md.logprobs,
        join=_join_logprobs,
        split=_split_logprobs,
    ),
)


def written_arrays(md: TraceMetadata) -> tuple[FlatArray, ...]:
    """The arrays a new trace with this metadata holds."""
    return tuple(a for a in ARRAYS if a.required or a.written(md))


def format_version_for(arrays: tuple[FlatArray, ...]) -> int:
    """The oldest format version whose readers understand a file holding ``arrays``."""
    return max(a.since for a in arrays)
