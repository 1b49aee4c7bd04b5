"""Requests out of a trace for other tools: JSON Lines, ``.npz`` or ``.npy``.

JSON Lines carry ``routed_experts`` the way vLLM and SGLang send it over HTTP:
the bytes ``np.save`` writes, in base64, so ``np.load(BytesIO(b64decode(s)))``
gives the array back with its shape and dtype.  The ``.npz`` holds the chosen
requests in CSR form (one flat array per kind plus offsets) and is written
array by array, chunk by chunk, so exporting a large trace needs little memory.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace, TraceRequest
from moetrace.trace.wire import npy_base64

FORMATS = ("jsonl", "npz", "npy")
DTYPES = ("stored", "int32", "int64")


def _cast(rows: np.ndarray, dtype: str) -> np.ndarray:
    return rows if dtype == "stored" else rows.astype(dtype)


def selected_requests(trace: Trace, positions: np.ndarray | None) -> Iterator[TraceRequest]:
    """All requests (read many at a time) or the chosen ones in record order."""
    if positions is None:
        yield from trace
    else:
        for p in positions:
            yield trace.request(int(p))


def json_line(req: TraceRequest, dtype: str = "stored") -> str:
    rows = _cast(req.routed_experts, dtype)
    return json.dumps(
        {
            "id": req.id,
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


def write_jsonl(requests: Iterable[TraceRequest], out: TextIO, dtype: str = "stored") -> int:
    n = 0
    for req in requests:
        out.write(json_line(req, dtype) + "\n")
        n += 1
    return n


def write_npy(req: TraceRequest, path: Path, dtype: str = "stored") -> None:
    np.save(path, _cast(req.routed_experts, dtype), allow_pickle=False)


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


def write_npz(trace: Trace, positions: np.ndarray | None, path: Path, dtype: str = "stored") -> int:
    """The chosen requests as CSR arrays; returns how many.

    ``routed_experts`` (rows, L, k) and ``token_ids`` are the requests'
    concatenations; request i has rows ``row_offsets[i]:row_offsets[i+1]`` and
    tokens ``token_offsets[i]:token_offsets[i+1]`` (prompt first, ``prompt_lens[i]``
    of them).  ``ids``, ``index``, ``finish_reasons`` and ``moe_layer_indices`` complete it.
    """
    t = trace.requests if positions is None else trace.requests[positions]
    n_rows = t["num_rows"].astype(np.int64)
    n_tok = (t["prompt_len"] + t["output_len"]).astype(np.int64)
    stored = np.dtype(trace.metadata["expert_id_dtype"]).newbyteorder("<")
    row_dtype = stored if dtype == "stored" else np.dtype(dtype)
    shape = (int(n_rows.sum()), trace.num_moe_layers, trace.top_k)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        rows_out = _NpzArray(zf, "routed_experts", row_dtype, shape)
        for req in selected_requests(trace, positions):
            rows_out.write(req.routed_experts)
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
            "index": t["index"].astype(np.int64),
            "finish_reasons": np.array(
                [trace.finish_reason_name(c) for c in t["finish_reason"]], dtype=str
            ),
            "moe_layer_indices": np.asarray(trace.metadata["moe_layer_indices"], dtype=np.int64),
        }
        for name, array in small.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
    return len(t)


def check_format(fmt: str, output: Path | None, count: int) -> None:
    if fmt not in FORMATS:
        raise MoetraceError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "jsonl" and output is None:
        raise MoetraceError(f"--format {fmt} writes a file: give it with -o")
    if fmt == "npy" and count != 1:
        raise MoetraceError(
            f".npy holds one array and {count} requests are selected: pick one with "
            "--request, or use --format npz"
        )
