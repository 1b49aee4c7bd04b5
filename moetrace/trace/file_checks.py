"""What only the file as a whole can tell is wrong: layout attributes, counts, ids, tokenizer files.

``moetrace verify`` lists every such problem; the reader checks the same on
open (when it checks at all) and refuses the file on the first, so that
``export`` and ``inspect`` refuse every file ``verify`` calls damaged.  (The
outside attack found them writing rows from damaged files with exit 0, and a
damaged tokenizer file ended ``inspect`` in a traceback.)  None of these
checks reads routing rows: they cost about as much as opening the file.
"""

from __future__ import annotations

import h5py
import numpy as np

from moetrace.trace import tokenizer_files
from moetrace.trace.integrity import plain_value
from moetrace.trace.metadata import expert_id_dtype
from moetrace.trace.records import ROUTED_EXPERTS, TOKEN_IDS


def check_variable_length(dtype: np.dtype, where: str) -> None:
    """Refuse a variable-length type that is not a string before anything is read with it.

    HDF5 crashes the process, instead of failing, reading a value whose
    variable-length string type is damaged (one flipped bit in the type made a
    string a sequence); every variable-length value a trace holds is a string.
    """
    fields = [dtype[name] for name in dtype.names] if dtype.names else [dtype]
    for field in fields:
        if field.kind == "O" and h5py.check_string_dtype(field) is None:
            raise ValueError(f"{where} has a damaged datatype")


def checked_attributes(attrs: h5py.AttributeManager) -> dict:
    """Every root attribute as plain Python, its type checked before its value is read."""
    out = {}
    for name in attrs:
        check_variable_length(attrs.get_id(name).dtype, f"attribute {name!r}")
        out[name] = plain_value(attrs[name])
    return out


def whole_file_problems(f: h5py.File, records: np.ndarray, complete: bool) -> list[str]:
    """Every problem of the file beyond its records' own data, one line each."""
    problems = layout_attr_problems(f.attrs, f[ROUTED_EXPERTS])
    if complete:
        problems += _count_problems(f, records)
    problems += _duplicate_problems(records)
    return problems + tokenizer_files.problems(f)


def layout_attr_problems(attrs, routed: h5py.Dataset) -> list[str]:
    """The attributes that describe a row must agree with the rows actually stored."""
    problems = []
    layers, top_k = int(attrs.get("num_moe_layers", -1)), int(attrs.get("top_k", -1))
    if tuple(routed.shape[1:]) != (layers, top_k):
        problems.append(
            f"attributes say rows of {layers} layers x top-{top_k}, "
            f"routed_experts holds {list(routed.shape[1:])}"
        )
    indices = attrs.get("moe_layer_indices")
    if indices is not None and len(indices) != layers:
        problems.append(f"moe_layer_indices has {len(indices)} entries for {layers} MoE layers")
    try:
        narrow = expert_id_dtype(int(attrs.get("num_experts", 0)))
    except ValueError as exc:
        return [*problems, f"attribute num_experts: {exc}"]
    if routed.dtype != narrow or str(attrs.get("expert_id_dtype")) != narrow.name:
        problems.append(
            f"expert ids stored as {routed.dtype} (attribute {attrs.get('expert_id_dtype')}), "
            f"{attrs.get('num_experts')} experts need {narrow}"
        )
    return problems


def _count_problems(f: h5py.File, records: np.ndarray) -> list[str]:
    """A complete file: the root counts and the datasets' lengths are what the records add up to."""
    attrs = f.attrs
    rows = int(records["num_rows"].sum()) if len(records) else 0
    tokens = int((records["prompt_len"] + records["output_len"]).sum()) if len(records) else 0
    problems = []
    counts = {"num_requests": len(records), "num_rows": rows, "num_tokens": tokens}
    for name, actual in counts.items():
        if int(attrs.get(name, actual)) != actual:
            problems.append(
                f"root attribute {name} is {int(attrs[name])}, the records account for {actual}"
            )
    extents = (f[ROUTED_EXPERTS].shape[0], f[TOKEN_IDS].shape[0])
    if extents != (rows, tokens):
        problems.append(
            f"datasets hold {extents[0]} rows and {extents[1]} tokens, "
            f"records account for {rows} and {tokens}"
        )
    expected = int(attrs.get("expected_requests", -1))
    if expected >= 0 and expected != len(records):
        problems.append(
            f"marked complete with {len(records)} requests, but the run expected {expected}"
        )
    return problems


def _duplicate_problems(records: np.ndarray) -> list[str]:
    """A request (id and sample) recorded twice; the samples of one prompt share its id."""
    names = records.dtype.names or ()
    samples = records["sample_index"].tolist() if "sample_index" in names else [0] * len(records)
    seen: set[tuple[str, int]] = set()
    for rid, sample in zip(records["id"].tolist(), samples, strict=True):
        if (rid, sample) in seen:
            which = f"request id {rid!r}" + (f" (sample {sample})" if sample else "")
            return [f"{which} is recorded more than once"]
        seen.add((rid, sample))
    return []
