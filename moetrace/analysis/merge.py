"""One trace from shards of the same recording (``--num-shards`` runs on several machines).

Shards must agree on everything that gives rows their meaning: format, model
(config digest), routing shape, expert id dtype and compute dtype.  Requests
are copied shard by shard in record order through the ordinary writer, so the
merged file has fresh checksums and the layout of a single recording; where
each request came from is kept in the root attribute ``merged_from``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import h5py

from moetrace.errors import MoetraceError
from moetrace.inputs.shards import check_shard_set
from moetrace.output_files import check_new_output, check_not_an_input, replacing
from moetrace.trace.lock import TraceLock
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.reader import Trace, open_trace
from moetrace.trace.verify import PARTIAL_MERGE
from moetrace.trace.writer import TraceWriter

MUST_MATCH = (
    "format_version",
    "architecture",
    "config_digest",
    "num_hidden_layers",
    "moe_layer_indices",
    "num_experts",
    "top_k",
    "vocab_size",
    "expert_id_dtype",
    "row_order",
    "dtype",
)
# Which optional arrays a shard holds, beside its attributes.
ARRAYS_MUST_MATCH = ("weights_dtype", "has_logprobs")


def metadata_of(trace: Trace) -> TraceMetadata:
    md = trace.metadata
    return TraceMetadata(
        model=md["model"],
        architecture=md["architecture"],
        config_digest=md["config_digest"],
        num_hidden_layers=int(md["num_hidden_layers"]),
        moe_layer_indices=[int(x) for x in md["moe_layer_indices"]],
        num_experts=int(md["num_experts"]),
        top_k=int(md["top_k"]),
        vocab_size=int(md["vocab_size"]),
        tokenizer=md.get("tokenizer") or None,
        dtype=md["dtype"],
        engine_settings=md.get("engine_settings") or {},
        weights_dtype=trace.weights_dtype,
        logprobs=trace.has_logprobs,
        tokenizer_files=trace.tokenizer_files,
    )


def check_shards(shards: Sequence[Trace], allow_incomplete: bool = False) -> tuple[list, list]:
    """Refuse shards that cannot be one recording.

    Returns (notes about harmless differences, reasons the merged trace is
    partial: shards of the split not given, shards whose recording did not finish).
    """
    first = shards[0]
    notes = []
    for shard in shards[1:]:
        for key in MUST_MATCH:
            a, b = first.metadata.get(key), shard.metadata.get(key)
            if a != b:
                raise MoetraceError(
                    f"{shard.path} is not a shard of the same recording as {first.path}: "
                    f"{key} {b!r} vs {a!r}"
                )
        for name in ARRAYS_MUST_MATCH:
            a, b = getattr(first, name), getattr(shard, name)
            if a != b:
                raise MoetraceError(
                    f"{shard.path} is not a shard of the same recording as {first.path}: "
                    f"{name} {b!r} vs {a!r}"
                )
        if shard.metadata.get("model") != first.metadata.get("model"):
            notes.append(
                f"model given as {shard.metadata['model']!r} in {shard.path} and "
                f"{first.metadata['model']!r} in {first.path} (same config digest)"
            )
    partial = []
    for shard in shards:
        if not shard.complete:
            if not allow_incomplete:
                raise MoetraceError(
                    f"{shard.path} is incomplete (its recording did not finish); resume it, or "
                    "merge anyway with --allow-incomplete"
                )
            partial.append(f"{shard.path} is incomplete")
    seen: dict[tuple[str, int], Path] = {}
    for shard in shards:
        for rid, sample in zip(shard.request_ids, shard.sample_indices.tolist(), strict=True):
            if (rid, sample) in seen:
                raise MoetraceError(
                    f"request id {rid!r} is in both {seen[rid, sample]} and {shard.path}: "
                    "shards of one recording hold disjoint requests"
                )
            seen[rid, sample] = shard.path
    # Shards of a --num-shards run: one of each, from the same split (prompt_shards.py).
    settings = [s.metadata.get("engine_settings") or {} for s in shards]
    missing = check_shard_set(settings, [str(s.path) for s in shards])
    if missing:
        total = int(settings[0]["num_shards"])
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        partial.append(f"shard(s) {shown} of {total} not given")
    indices = [int(i) for s in shards for i in s.requests["index"]]
    if len(set(indices)) != len(indices):
        notes.append("request index values repeat across shards (each numbered its own input)")
    return notes, partial


def merge_traces(
    output: str | os.PathLike,
    shard_paths: Sequence[str | os.PathLike],
    *,
    overwrite: bool = False,
    allow_incomplete: bool = False,
    as_complete: bool = False,
) -> dict:
    """Write ``output`` from ``shard_paths``; returns counts, notes and why it is partial.

    A merge that lacks shards of the split, or holds a shard whose recording
    did not finish, is closed incomplete (``verify`` says so) unless
    ``as_complete``: the user says the subset is what they want.
    """
    if not shard_paths:
        raise MoetraceError("give at least one shard to merge")
    out = Path(output)
    check_not_an_input(out, [(f"the shard {p}", p) for p in shard_paths])
    check_new_output(out, overwrite=overwrite)
    shards = []
    lock = TraceLock(out).acquire()
    try:
        for p in shard_paths:
            shards.append(open_trace(p))
        notes, partial = check_shards(shards, allow_incomplete)
        # Written beside OUT and renamed over it only when every shard went in: a damaged
        # shard must not cost the user the file that --overwrite was to replace.
        with replacing(out) as temporary:
            provenance, requests, rows, complete = _write_merged(
                temporary, shards, partial, as_complete, lock
            )
            with h5py.File(temporary, "r+", locking=False) as f:
                f.attrs["merged_from"] = json.dumps(provenance, sort_keys=True)
    finally:
        for shard in shards:
            shard.close()
        lock.release()
    return {
        "output": str(out),
        "shards": len(shards),
        "requests": requests,
        "rows": rows,
        "notes": notes,
        "partial": partial,
        "complete": complete,
    }


def _write_merged(
    path: Path, shards: list[Trace], partial: list[str], as_complete: bool, lock: TraceLock
) -> tuple[list[dict], int, int, bool]:
    """Copy every shard's requests into a new trace at ``path``; provenance and counts."""
    first = shards[0]
    writer = TraceWriter(
        path,
        metadata_of(first),
        chunk_rows=first.chunk_rows,
        compression="gzip" if first.compression == "gzip" else None,
        lock=lock,
    )
    provenance, requests, rows = [], 0, 0
    complete = not partial or as_complete
    end_reason = "complete" if not partial else f"{PARTIAL_MERGE}: " + "; ".join(partial)
    writer.start()
    try:
        for shard in shards:
            for req in shard:
                writer.submit(req)  # a TraceRequest is the FinishedRequest it was written from
            provenance.append(
                {
                    "path": str(shard.path),
                    "created": shard.metadata.get("created"),
                    "requests": shard.num_requests,
                    "rows": shard.num_rows,
                    "complete": shard.complete,
                    "engine_settings": shard.metadata.get("engine_settings") or {},
                }
            )
            requests += shard.num_requests
            rows += shard.num_rows
    except BaseException:
        writer.close(complete=False, end_reason="merge failed")
        raise
    writer.close(complete=complete, end_reason=end_reason)
    return provenance, requests, rows, complete
