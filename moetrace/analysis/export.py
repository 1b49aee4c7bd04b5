"""Requests out of a trace for other tools: JSON Lines, ``.npz``, ``.npy`` or Parquet.

JSON Lines carry ``routed_experts`` the way vLLM and SGLang send it over HTTP:
the bytes ``np.save`` writes, in base64, so ``np.load(BytesIO(b64decode(s)))``
gives the array back with its shape and dtype.  The ``.npz`` holds the chosen
requests in CSR form (one flat array per kind plus offsets) and is written
array by array, chunk by chunk, so exporting a large trace needs little memory.
Parquet has one row per request (pandas, Hugging Face ``datasets`` and Arrow
read it without moetrace) and is written a row group at a time.

The ``vllm`` layout gives each row every hidden layer, as vLLM returns routed
experts, with zeros for the layers that do not route (dense layers).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np

from moetrace.errors import MoetraceError
from moetrace.output_files import STDOUT
from moetrace.trace.reader import Trace, TraceRequest
from moetrace.trace.wire import hidden_layer_rows, npy_base64

FORMATS = ("jsonl", "npz", "npy", "parquet", "eplb", "eplb-npy")
BINARY_FORMATS = ("npz", "npy", "parquet", "eplb-npy")
LOAD_FORMATS = ("eplb", "eplb-npy")  # one load matrix for the selection, not rows
DTYPES = ("stored", "int32", "int64")
# The formats a file name's extension allows, the first one what it means alone.
SUFFIX_FORMATS = {
    ".jsonl": ("jsonl",),
    ".ndjson": ("jsonl",),
    ".json": ("eplb",),
    ".npz": ("npz",),
    ".npy": ("npy", "eplb-npy"),
    ".parquet": ("parquet",),
    ".pq": ("parquet",),
}
LAYOUTS = ("moe", "vllm")
PARQUET_ROWS = 65536  # routing rows per Parquet row group


@dataclass(frozen=True)
class Layout:
    """How routing rows are laid out on the layer axis."""

    name: str  # "moe": one entry per MoE layer; "vllm": one per hidden layer, dense ones zero
    moe_layer_indices: tuple[int, ...]
    num_hidden_layers: int

    @classmethod
    def of(cls, trace: Trace, name: str) -> Layout:
        if name not in LAYOUTS:
            raise MoetraceError(f"--layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
        md = trace.metadata
        return cls(
            name, tuple(int(x) for x in md["moe_layer_indices"]), int(md["num_hidden_layers"])
        )

    @property
    def layers(self) -> list[int]:
        """The decoder layer of each entry of the layer axis."""
        if self.name == "vllm":
            return list(range(self.num_hidden_layers))
        return list(self.moe_layer_indices)

    def apply(self, rows: np.ndarray) -> np.ndarray:
        if self.name == "moe":
            return rows
        return hidden_layer_rows(rows, self.moe_layer_indices, self.num_hidden_layers)


def _cast(rows: np.ndarray, dtype: str) -> np.ndarray:
    return rows if dtype == "stored" else rows.astype(dtype)


def selected_requests(trace: Trace, positions: np.ndarray | None) -> Iterator[TraceRequest]:
    """All requests (read many at a time) or the chosen ones in record order."""
    if positions is None:
        yield from trace
    else:
        for p in positions:
            yield trace.request(int(p))


def json_line(req: TraceRequest, dtype: str = "stored", layout: Layout | None = None) -> str:
    rows = _cast(req.routed_experts if layout is None else layout.apply(req.routed_experts), dtype)
    return json.dumps(
        {
            "id": req.id,
            "sample_index": req.sample_index,
            "index": req.index,
            "finish_reason": req.finish_reason,
            "prompt_token_ids": req.prompt_token_ids.tolist(),
            "output_token_ids": req.output_token_ids.tolist(),
            "routed_experts": npy_base64(rows),
            "shape": list(rows.shape),
            "dtype": rows.dtype.name,
        },
        ensure_ascii=False,
    )


def write_jsonl(
    requests: Iterable[TraceRequest],
    out: TextIO,
    dtype: str = "stored",
    layout: Layout | None = None,
) -> int:
    n = 0
    for req in requests:
        out.write(json_line(req, dtype, layout) + "\n")
        n += 1
    return n


def write_npy(
    req: TraceRequest, out: Path | BinaryIO, dtype: str = "stored", layout: Layout | None = None
) -> None:
    rows = req.routed_experts if layout is None else layout.apply(req.routed_experts)
    np.save(out, _cast(rows, dtype), allow_pickle=False)


class _NpzArray:
    """One array of an ``.npz`` written in pieces: header first, then the data in order."""

    def __init__(self, zf: zipfile.ZipFile, name: str, dtype: np.dtype, shape: tuple) -> None:
        self.stream: BinaryIO = zf.open(f"{name}.npy", "w", force_zip64=True)
        header = {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": shape,
        }
        np.lib.format.write_array_header_2_0(self.stream, header)
        self.dtype = dtype

    def write(self, data: np.ndarray) -> None:
        self.stream.write(np.ascontiguousarray(data, dtype=self.dtype).tobytes())

    def close(self) -> None:
        self.stream.close()


def write_npz(
    trace: Trace,
    positions: np.ndarray | None,
    out: Path | BinaryIO,
    dtype: str = "stored",
    layout: Layout | None = None,
) -> int:
    """The chosen requests as CSR arrays; returns how many.

    ``routed_experts`` (rows, layers, k) and ``token_ids`` are the requests'
    concatenations; request i has rows ``row_offsets[i]:row_offsets[i+1]`` and
    tokens ``token_offsets[i]:token_offsets[i+1]`` (prompt first, ``prompt_lens[i]``
    of them).  ``ids``, ``sample_index``, ``index``, ``finish_reasons`` and
    ``layer_indices`` (the decoder layer of each entry of the layer axis)
    complete it.
    """
    layout = layout or Layout.of(trace, "moe")
    t = trace.requests if positions is None else trace.requests[positions]
    samples = trace.sample_indices if positions is None else trace.sample_indices[positions]
    n_rows = t["num_rows"].astype(np.int64)
    n_tok = (t["prompt_len"] + t["output_len"]).astype(np.int64)
    stored = np.dtype(trace.metadata["expert_id_dtype"]).newbyteorder("<")
    row_dtype = stored if dtype == "stored" else np.dtype(dtype)
    shape = (int(n_rows.sum()), len(layout.layers), trace.top_k)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        rows_out = _NpzArray(zf, "routed_experts", row_dtype, shape)
        for req in selected_requests(trace, positions):
            rows_out.write(layout.apply(req.routed_experts))
        rows_out.close()
        tokens_out = _NpzArray(zf, "token_ids", np.dtype("<i4"), (int(n_tok.sum()),))
        for req in selected_requests(trace, positions):
            tokens_out.write(req.prompt_token_ids)
            tokens_out.write(req.output_token_ids)
        tokens_out.close()
        small = {
            "row_offsets": np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int64),
            "token_offsets": np.concatenate([[0], np.cumsum(n_tok)]).astype(np.int64),
            "prompt_lens": t["prompt_len"].astype(np.int64),
            "ids": np.array(t["id"].tolist(), dtype=str),
            "sample_index": samples.astype(np.int64),
            "index": t["index"].astype(np.int64),
            "finish_reasons": np.array(
                [trace.finish_reason_name(c) for c in t["finish_reason"]], dtype=str
            ),
            "moe_layer_indices": np.asarray(layout.moe_layer_indices, dtype=np.int64),
            "layer_indices": np.asarray(layout.layers, dtype=np.int64),
        }
        for name, array in small.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
    return len(t)


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
        "row_order": md.get("row_order", "router"),
    }
    return {"moetrace": json.dumps(about)}


def write_parquet(
    trace: Trace,
    positions: np.ndarray | None,
    out: Path | BinaryIO,
    dtype: str = "stored",
    layout: Layout | None = None,
) -> int:
    """One row per request: ids, tokens and ``routed_experts`` as nested fixed-size lists.

    ``routed_experts`` is ``list<fixed_size_list<fixed_size_list<int, k>, layers>>``:
    a request's rows, each its layers, each its k expert ids in router order.
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MoetraceError(
            "--format parquet needs pyarrow: pip install 'moetrace[parquet]'"
        ) from None
    layout = layout or Layout.of(trace, "moe")
    stored = np.dtype(trace.metadata["expert_id_dtype"])
    row_dtype = stored if dtype == "stored" else np.dtype(dtype)
    layers, k = len(layout.layers), trace.top_k
    expert = pa.from_numpy_dtype(row_dtype)
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("sample_index", pa.int32()),
            ("index", pa.int64()),
            ("finish_reason", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("output_token_ids", pa.list_(pa.int32())),
            ("num_rows", pa.int64()),
            ("routed_experts", pa.list_(pa.list_(pa.list_(expert, k), layers))),
        ],
        metadata=parquet_metadata(trace, layout, dtype),
    )
    count = 0
    with pq.ParquetWriter(out, schema) as writer:
        batch: list[TraceRequest] = []
        rows_in_batch = 0
        for req in selected_requests(trace, positions):
            batch.append(req)
            rows_in_batch += req.num_rows
            if rows_in_batch >= PARQUET_ROWS:
                writer.write_table(_parquet_table(batch, schema, layout, row_dtype, k))
                count += len(batch)
                batch, rows_in_batch = [], 0
        if batch or not count:
            writer.write_table(_parquet_table(batch, schema, layout, row_dtype, k))
            count += len(batch)
    return count


def _parquet_table(batch: list[TraceRequest], schema, layout: Layout, row_dtype: np.dtype, k: int):
    import pyarrow as pa

    def tokens(arrays: list[np.ndarray]):
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return pa.ListArray.from_arrays(offsets, pa.array(flat.astype(np.int32)))

    rows = [layout.apply(r.routed_experts).astype(row_dtype, copy=False) for r in batch]
    layers = len(layout.layers)
    flat = np.concatenate([r.reshape(-1) for r in rows]) if rows else np.zeros(0, row_dtype)
    per_row = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(flat), k), layers
    )
    row_offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    columns = [
        pa.array([r.id for r in batch], pa.string()),
        pa.array([r.sample_index for r in batch], pa.int32()),
        pa.array([r.index for r in batch], pa.int64()),
        pa.array([r.finish_reason for r in batch], pa.string()),
        tokens([r.prompt_token_ids for r in batch]),
        tokens([r.output_token_ids for r in batch]),
        pa.array([r.num_rows for r in batch], pa.int64()),
        pa.ListArray.from_arrays(pa.array(row_offsets), per_row),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def format_for_output(fmt: str | None, output: str) -> str:
    """The format to write: ``fmt`` as given, else the one ``output``'s extension names, else jsonl.

    Raises ``ValueError`` (a usage error) when the extension names another format
    than ``fmt``: ``-o t.parquet --format jsonl`` would write JSON into a
    ``.parquet`` file that every Parquet reader then refuses.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    allowed = None if output == STDOUT else SUFFIX_FORMATS.get(Path(output).suffix.lower())
    if allowed is None:
        return fmt or "jsonl"
    if fmt is None:
        return allowed[0]
    if fmt not in allowed:
        names = " or ".join(allowed)
        raise ValueError(
            f"{fmt} contradicts the output's extension ({output} is {names}); "
            "rename the file or drop --format"
        )
    return fmt


def check_format(fmt: str, count: int) -> None:
    if fmt not in FORMATS:
        raise MoetraceError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "npy" and count != 1:
        raise MoetraceError(
            f".npy holds one array and {count} requests are selected: pick one with "
            "--request, or use --format npz"
        )
