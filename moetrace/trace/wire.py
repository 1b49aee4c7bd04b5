"""Routed experts as vLLM and SGLang send them over HTTP.

A trace keeps one row per token with the MoE layers only (``(rows,
num_moe_layers, top_k)``).  Both engines size the layer axis by the model's
``num_hidden_layers`` instead and leave dense layers' rows at zero; this
module converts to that layout and encodes it the two ways clients decode:

- vLLM (``choices[i].routed_experts``): base64 of the bytes ``np.save``
  writes, so ``np.load(io.BytesIO(base64.b64decode(s)))`` returns the array
  with its shape and dtype (uint8 up to 256 experts, uint16 above, as in
  vLLM's newest code; older vLLM sent int32).
- SGLang (``meta_info.routed_experts``): base64 of the flat row-major int32
  buffer, which its clients read with ``np.frombuffer(..., dtype=np.int32)``
  and reshape to ``(-1, num_hidden_layers * top_k)``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import pybase64


def npy_base64(array: np.ndarray) -> str:
    """Base64 of the ``.npy`` bytes of ``array`` (the vLLM encoding)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return pybase64.b64encode(buf.getbuffer()).decode("ascii")


def int32_base64(array: np.ndarray) -> str:
    """Base64 of ``array`` as flat little-endian int32 (the SGLang encoding)."""
    flat = np.ascontiguousarray(array, dtype="<i4")
    return pybase64.b64encode(flat.data).decode("ascii")


def float32_base64(array: np.ndarray) -> str:
    """Base64 of ``array`` as flat little-endian float32 (gate weights, SGLang-style)."""
    flat = np.ascontiguousarray(array, dtype="<f4")
    return pybase64.b64encode(flat.data).decode("ascii")


def hidden_layer_rows(
    rows: np.ndarray, moe_layer_indices: Sequence[int], num_hidden_layers: int
) -> np.ndarray:
    """``(n, num_moe_layers, k)`` rows spread over every hidden layer, dense layers zero.

    The dtype is kept, so the narrow trace dtype (uint8 up to 256 experts)
    is what vLLM's newest code sends too.
    """
    n, num_moe, top_k = rows.shape
    if num_moe != len(moe_layer_indices):
        raise ValueError(f"{num_moe} MoE layers in the rows, {len(moe_layer_indices)} indices")
    if num_moe == num_hidden_layers:
        return np.ascontiguousarray(rows)
    out = np.zeros((n, num_hidden_layers, top_k), dtype=rows.dtype)
    out[:, list(moe_layer_indices)] = rows
    return out


def raw_base64(array: np.ndarray) -> str:
    """Base64 of ``array``'s bytes in C order, as stored (prime-rl's ``routed_experts.data``)."""
    return pybase64.b64encode(np.ascontiguousarray(array).data).decode("ascii")
