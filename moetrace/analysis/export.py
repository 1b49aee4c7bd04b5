"""Requests out of a trace for other tools: JSON Lines, ``.npz`` or ``.npy`` (Parquet and
OpenAI batch output lines have modules of their own).

Every format carries every per-token field the trace holds, under the name
the engines give it: ``routed_experts`` (and ``routed_weights`` beside it,
as ``moetrace serve`` returns them), ``token_logprobs`` (one per output
token, as vLLM's completions ``logprobs.token_logprobs``) and each request's
``stop_reason``.  JSON Lines carry the arrays as vLLM sends ``routed_experts``
over HTTP: the bytes ``np.save`` writes, in base64, so
``np.load(BytesIO(b64decode(s)))`` gives the array back with its shape and
dtype (SGLang sends the raw int32 bytes instead, without shape or dtype).  The
``.npz`` holds the chosen requests in CSR form (one flat array per
kind plus offsets) and is written array by array, chunk by chunk, so
exporting a large trace needs little memory.

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

FORMATS = ("jsonl", "npz", "npy", "parquet", "openai-batch", "eplb", "eplb-npy")
# The per-token arrays a request may carry, by their exported names (``--array`` for .npy).
ROUTED_EXPERTS, ROUTED_WEIGHTS, TOKEN_LOGPROBS = (
    "routed_experts",
    "routed_weights",
    "token_logprobs",
)
ARRAY_NAMES = (ROUTED_EXPERTS, ROUTED_WEIGHTS, TOKEN_LOGPROBS)
BINARY_FORMATS = ("npz", "npy", "parquet", "eplb-npy")
LOAD_FORMATS = ("eplb", "eplb-npy")  # one load matrix for the selection, not rows
DTYPES = ("stored", "int32", "int64")
# The formats a file name's extension allows, the first one what it means alone.
SUFFIX_FORMATS = {
    ".jsonl": ("jsonl", "openai-batch"),
    ".ndjson": ("jsonl", "openai-batch"),
    ".json": ("eplb",),
    ".npz": ("npz",),
    ".npy": ("npy", "eplb-npy"),
    ".parquet": ("parquet",),
    ".pq": ("parquet",),
}
LAYOUTS = ("moe", "vllm")


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


def held_arrays(trace: Trace) -> tuple[str, ...]:
    """The per-token arrays the trace holds, by their exported names."""
    held = [ROUTED_EXPERTS]
    if trace.weights_dtype is not None:
        held.append(ROUTED_WEIGHTS)
    if trace.has_logprobs:
        held.append(TOKEN_LOGPROBS)
    return tuple(held)


def request_array(
    req: TraceRequest, name: str, dtype: str = "stored", layout: Layout | None = None
) -> np.ndarray:
    """One of the request's per-token arrays as exported (ids cast, rows laid out)."""
    if name == TOKEN_LOGPROBS:
        return req.output_logprobs
    rows = req.routed_experts if name == ROUTED_EXPERTS else req.routed_weights
    rows = rows if layout is None else layout.apply(rows)
    return _cast(rows, dtype) if name == ROUTED_EXPERTS else rows


def stop_reason_text(reason: int | str | None) -> str:
    """vLLM's stop_reason as JSON text, "" for none (as the trace's table keeps it)."""
    return "" if reason is None else json.dumps(reason)


def selected_requests(trace: Trace, positions: np.ndarray | None) -> Iterator[TraceRequest]:
    """All requests (read many at a time) or the chosen ones in record order."""
    if positions is None:
        yield from trace
    else:
        for p in positions:
            yield trace.request(int(p))


def json_line(req: TraceRequest, dtype: str = "stored", layout: Layout | None = None) -> str:
    """One request: ids, tokens, stop reason, settings and every array it holds."""
    rows = request_array(req, ROUTED_EXPERTS, dtype, layout)
    line = {
        "id": req.id,
        "sample_index": req.sample_index,
        "index": req.index,
        "finish_reason": req.finish_reason,
        "stop_reason": req.stop_reason,
        "prompt_token_ids": req.prompt_token_ids.tolist(),
        "output_token_ids": req.output_token_ids.tolist(),
        "routed_experts": npy_base64(rows),
        "shape": list(rows.shape),
        "dtype": rows.dtype.name,
    }
    if req.routed_weights is not None:
        line[ROUTED_WEIGHTS] = npy_base64(request_array(req, ROUTED_WEIGHTS, layout=layout))
    if req.output_logprobs is not None:
        line[TOKEN_LOGPROBS] = req.output_logprobs.tolist()
    if req.sampling_params:
        line["sampling_params"] = req.sampling_params
    return json.dumps(line, ensure_ascii=False)


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
    req: TraceRequest,
    out: Path | BinaryIO,
    dtype: str = "stored",
    layout: Layout | None = None,
    array: str = ROUTED_EXPERTS,
) -> None:
    """One array of one request (``array``: routed_experts, routed_weights or token_logprobs)."""
    np.save(out, request_array(req, array, dtype, layout), allow_pickle=False)


def check_array(trace: Trace, array: str) -> None:
    """``--array`` names an array the trace holds."""
    if array not in ARRAY_NAMES:
        raise MoetraceError(f"--array must be one of {', '.join(ARRAY_NAMES)}, got {array!r}")
    if array not in held_arrays(trace):
        flag = "--record-weights" if array == ROUTED_WEIGHTS else "--logprobs"
        raise MoetraceError(
            f"{trace.path} holds no {array} (record with {flag}); it holds "
            + ", ".join(held_arrays(trace))
        )


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

    ``routed_experts`` (rows, layers, k), ``routed_weights`` (the same, when the
    trace holds them), ``token_ids`` and ``token_logprobs`` (output tokens, when
    held) are the requests' concatenations; request i has rows
    ``row_offsets[i]:row_offsets[i+1]``, tokens ``token_offsets[i]:token_offsets[i+1]``
    (prompt first, ``prompt_lens[i]`` of them) and output log-probabilities
    ``output_offsets[i]:output_offsets[i+1]``.  ``ids``, ``sample_index``,
    ``index``, ``finish_reasons``, ``stop_reasons`` (JSON text, "" for none) and
    ``layer_indices`` (the decoder layer of each entry of the layer axis)
    complete it.
    """
    layout = layout or Layout.of(trace, "moe")
    t = trace.requests if positions is None else trace.requests[positions]
    samples = trace.sample_indices if positions is None else trace.sample_indices[positions]
    n_rows = t["num_rows"].astype(np.int64)
    n_tok = (t["prompt_len"] + t["output_len"]).astype(np.int64)
    n_out = t["output_len"].astype(np.int64)
    stored = np.dtype(trace.metadata["expert_id_dtype"]).newbyteorder("<")
    row_dtype = stored if dtype == "stored" else np.dtype(dtype)
    row_shape = (int(n_rows.sum()), len(layout.layers), trace.top_k)
    flat = {
        ROUTED_EXPERTS: (row_dtype, row_shape),
        "token_ids": (np.dtype("<i4"), (int(n_tok.sum()),)),
    }
    held = held_arrays(trace)
    if ROUTED_WEIGHTS in held:
        flat[ROUTED_WEIGHTS] = (np.dtype(trace.weights_dtype).newbyteorder("<"), row_shape)
    if TOKEN_LOGPROBS in held:
        flat[TOKEN_LOGPROBS] = (np.dtype("<f4"), (int(n_out.sum()),))
    stop_reasons = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, (array_dtype, shape) in flat.items():  # one pass over the requests each
            array_out = _NpzArray(zf, name, array_dtype, shape)
            for req in selected_requests(trace, positions):
                if name == "token_ids":
                    array_out.write(req.prompt_token_ids)
                    array_out.write(req.output_token_ids)
                else:
                    array_out.write(request_array(req, name, dtype, layout))
                if name == ROUTED_EXPERTS:
                    stop_reasons.append(stop_reason_text(req.stop_reason))
            array_out.close()
        small = {
            "row_offsets": np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int64),
            "token_offsets": np.concatenate([[0], np.cumsum(n_tok)]).astype(np.int64),
            "output_offsets": np.concatenate([[0], np.cumsum(n_out)]).astype(np.int64),
            "prompt_lens": t["prompt_len"].astype(np.int64),
            "ids": np.array(t["id"].tolist(), dtype=str),
            "sample_index": samples.astype(np.int64),
            "index": t["index"].astype(np.int64),
            "finish_reasons": np.array(
                [trace.finish_reason_name(c) for c in t["finish_reason"]], dtype=str
            ),
            "stop_reasons": np.array(stop_reasons, dtype=str),
            "moe_layer_indices": np.asarray(layout.moe_layer_indices, dtype=np.int64),
            "layer_indices": np.asarray(layout.layers, dtype=np.int64),
        }
        for name, array in small.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
    return len(t)


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
