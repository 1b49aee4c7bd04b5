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


def table_crc_problem(records, stated: int, crc: int, complete: bool) -> str:
    """The table checksum must cover the stated records exactly in a complete file.

    A run killed during a flush can leave the root attributes one flush behind
    or ahead of the table, so in an incomplete file the checksum only has to
    match some prefix of the records backed by data; records after it are
    vouched for by their own data checksums, as after any kill.
    """
    running, matched = 0, crc == 0
    for i, record in enumerate(records, 1):
        running = record_crc([record], running)
        if complete and i == stated:
            matched = running == crc
            break
        matched = matched or running == crc
    if matched:
        return ""
    where = f"its first {stated} records" if complete else "any prefix of its records"
    return (
        f"request table checksum mismatch over {where} "
        "(a record's id, lengths, offsets or reason was altered)"
    )


def metadata_problem(attrs) -> str:
    """What is wrong with the fixed root attributes ("" if nothing or no checksum)."""
    if "metadata_crc32" not in attrs:
        return ""
    try:
        same = metadata_crc(attrs) == int(attrs["metadata_crc32"])
    except (UnicodeError, ValueError, TypeError):
        same = False  # an attribute no longer text, or not a number
    if same:
        return ""
    return (
        "root attributes altered: the metadata checksum does not match "
        f"({', '.join(FIXED_ATTRS[:4])}, ... {FIXED_ATTRS[-1]})"
    )


def file_problem(attrs, records, complete: bool) -> str:
    """The checks a reader makes on open: root attributes, then the request table's CRC."""
    problem = metadata_problem(attrs)
    if problem or "requests_crc32" not in attrs:
        return problem
    stated = int(attrs.get("num_requests", -1))
    if complete and stated != len(records):
        return f"root attribute num_requests is {stated}, the request table holds {len(records)}"
    if not complete and stated > len(records):
        return ""  # the last flush did not finish: its records were left out, as after a kill
    return table_crc_problem(records, stated, int(attrs["requests_crc32"]), complete)
