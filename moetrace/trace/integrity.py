"""What a trace carries to check itself: the checksums and the row-count rule.

Kept apart from the writer because the reader, the verifier and anyone
re-implementing the format need exactly these definitions and nothing else;
docs/trace-format.md states them in words.
"""

from __future__ import annotations

import json
import zlib

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")


def request_checksum(routed_experts: np.ndarray, token_ids: np.ndarray, *more: np.ndarray) -> int:
    """CRC-32 of a request's slices of the flat arrays, one CRC continued over each in turn.

    Each slice counts as its raw bytes (stored dtype, little-endian, C order):
    first the routing rows, then the int32 tokens, then any further array the
    file holds, in the order ``trace.records.ARRAYS`` declares them.
    """
    crc = zlib.crc32(little_endian_bytes(routed_experts))
    crc = zlib.crc32(np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE), crc)
    for array in more:
        crc = zlib.crc32(little_endian_bytes(array), crc)
    return crc


def little_endian_bytes(array: np.ndarray) -> np.ndarray:
    """The array as the checksum reads it: stored dtype, little-endian, C order."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def expected_num_rows(prompt_len: int, output_len: int, finish_reason: str) -> range:
    """Row counts the format allows: the last sampled token is never run through the model."""
    tokens = prompt_len + output_len
    if finish_reason == "abort":
        return range(0, tokens + 1)
    return range(tokens - 1, tokens) if tokens else range(0)


def record_crc(records, crc: int = 0) -> int:
    """Continue ``crc`` over request records (tuples or rows of the table, in table order).

    Each record counts as the compact JSON array of its fields (finish reason
    as its code, strings as text) followed by a newline, so a verifier in any
    language can recompute it.
    """
    for rec in records:
        fields = [plain_value(value) for value in rec]
        line = json.dumps(fields, separators=(",", ":"), ensure_ascii=False) + "\n"
        crc = zlib.crc32(line.encode(), crc)
    return crc


# Root attributes written once, when the file is created; ``metadata_crc32`` covers them.
FIXED_ATTRS = (
    "format",
    "format_version",
    "model",
    "architecture",
    "config_digest",
    "num_hidden_layers",
    "num_moe_layers",
    "moe_layer_indices",
    "num_experts",
    "top_k",
    "vocab_size",
    "tokenizer",
    "dtype",
    "expert_id_dtype",
    "row_order",
    "engine_settings",
    "moetrace_version",
    "created",
)


def metadata_crc(attrs) -> int:
    """CRC-32 of the fixed root attributes as a compact JSON list of [name, value] pairs."""
    pairs = [[name, plain_value(attrs.get(name))] for name in FIXED_ATTRS]
    text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=False)
    return zlib.crc32(text.encode())


def plain_value(value):
    """An HDF5 attribute or table field as plain Python: text, list or scalar."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
