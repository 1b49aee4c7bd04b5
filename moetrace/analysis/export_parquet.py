"""``export --format parquet``: one row per request, for pandas, ``datasets`` and Arrow.

Written a row group at a time, so a trace larger than memory exports in
bounded memory.  Every per-token field the trace holds is a column, named as
in the other formats (``analysis/export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import numpy as np

from moetrace.analysis.export import (
    ROUTED_EXPERTS,
    ROUTED_WEIGHTS,
    TOKEN_LOGPROBS,
    Layout,
    held_arrays,
    request_array,
    selected_requests,
)
from moetrace.errors import MoetraceError, install_extra
from moetrace.trace.reader import Trace, TraceRequest

PARQUET_ROWS = 65536  # routing rows per Parquet row group


def parquet_metadata(trace: Trace, layout: Layout, dtype: str) -> dict[str, str]:
    """What the file says about itself (Parquet key-value metadata, key ``moetrace``)."""
    md = trace.metadata
    stored = np.dtype(md["expert_id_dtype"])
    about = {
        "format": "moetrace-parquet",
        "model": md.get("model"),
        "architecture": md.get("architecture"),
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "layout": layout.name,
        "layer_indices": layout.layers,
        "moe_layer_indices": list(layout.moe_layer_indices),
        "routed_experts_dtype": stored.name if dtype == "stored" else dtype,
        "routed_experts_shape": ["num_rows", len(layout.layers), trace.top_k],
        "routed_weights_dtype": trace.weights_dtype,
        "row_order": md.get("row_order", "router"),
    }
    return {"moetrace": json.dumps(about)}


def _schema(trace: Trace, layout: Layout, dtype: str):
    import pyarrow as pa

    stored = np.dtype(trace.metadata["expert_id_dtype"])
    row_dtype = stored if dtype == "stored" else np.dtype(dtype)
    layers, k = len(layout.layers), trace.top_k

    def rows_of(value_type):
        return pa.list_(pa.list_(pa.list_(value_type, k), layers))

    fields = [
        ("id", pa.string()),
        ("sample_index", pa.int32()),
        ("index", pa.int64()),
        ("finish_reason", pa.string()),
        ("stop_reason", pa.string()),  # JSON text: a stop token id or a stop string; null: none
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("num_rows", pa.int64()),
        (ROUTED_EXPERTS, rows_of(pa.from_numpy_dtype(row_dtype))),
    ]
    held = held_arrays(trace)
    if ROUTED_WEIGHTS in held:
        fields.append((ROUTED_WEIGHTS, rows_of(pa.from_numpy_dtype(np.dtype(trace.weights_dtype)))))
    if TOKEN_LOGPROBS in held:
        fields.append((TOKEN_LOGPROBS, pa.list_(pa.float32())))
    fields.append(("sampling_params", pa.string()))  # JSON object; null for none
    return pa.schema(fields, metadata=parquet_metadata(trace, layout, dtype))


def write_parquet(
    trace: Trace,
    positions: np.ndarray | None,
    out: Path | BinaryIO,
    dtype: str = "stored",
    layout: Layout | None = None,
) -> int:
    """One row per request: ids, tokens and the arrays as nested lists; returns how many.

    ``routed_experts`` (and ``routed_weights``) is
    ``list<fixed_size_list<fixed_size_list<value, k>, layers>>``: a request's
    rows, each its layers, each its k entries in router order.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MoetraceError(f"--format parquet needs pyarrow: {install_extra('parquet')}") from None
    layout = layout or Layout.of(trace, "moe")
    schema = _schema(trace, layout, dtype)
    count = 0
    with pq.ParquetWriter(out, schema) as writer:
        batch: list[TraceRequest] = []
        rows_in_batch = 0
        for req in selected_requests(trace, positions):
            batch.append(req)
            rows_in_batch += req.num_rows
            if rows_in_batch >= PARQUET_ROWS:
                writer.write_table(_table(batch, schema, layout, dtype))
                count += len(batch)
                batch, rows_in_batch = [], 0
        if batch or not count:
            writer.write_table(_table(batch, schema, layout, dtype))
            count += len(batch)
    return count


def _table(batch: list[TraceRequest], schema, layout: Layout, dtype: str):
    import pyarrow as pa

    def ragged(arrays: list[np.ndarray], value_type):
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
        flat = np.concatenate(arrays) if arrays else np.zeros(0)
        return pa.ListArray.from_arrays(offsets, pa.array(flat, value_type))

    def rows(name: str, value_type):
        arrays = [request_array(r, name, dtype, layout) for r in batch]
        layers, k = value_type.list_size, value_type.value_type.list_size
        flat = pa.array(
            np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0),
            value_type.value_type.value_type,
        )
        per_row = pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(flat, k), layers
        )
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), per_row)

    def json_or_null(values: list) -> pa.Array:
        return pa.array([None if v in (None, {}) else json.dumps(v) for v in values], pa.string())

    columns = {
        "id": pa.array([r.id for r in batch], pa.string()),
        "sample_index": pa.array([r.sample_index for r in batch], pa.int32()),
        "index": pa.array([r.index for r in batch], pa.int64()),
        "finish_reason": pa.array([r.finish_reason for r in batch], pa.string()),
        "stop_reason": json_or_null([r.stop_reason for r in batch]),
        "prompt_token_ids": ragged([r.prompt_token_ids for r in batch], pa.int32()),
        "output_token_ids": ragged([r.output_token_ids for r in batch], pa.int32()),
        "num_rows": pa.array([r.num_rows for r in batch], pa.int64()),
        "sampling_params": json_or_null([r.sampling_params for r in batch]),
    }
    for name in (ROUTED_EXPERTS, ROUTED_WEIGHTS):
        if name in schema.names:
            columns[name] = rows(name, schema.field(name).type.value_type)
    if TOKEN_LOGPROBS in schema.names:
        columns[TOKEN_LOGPROBS] = ragged([r.output_logprobs for r in batch], pa.float32())
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)
