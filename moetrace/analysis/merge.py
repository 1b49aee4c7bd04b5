"""One trace from shards of the same recording (``--num-shards`` runs on several machines).

Shards must agree on everything that gives rows their meaning: format, model
(config digest), routing shape, expert id dtype and compute dtype, the
optional arrays, and the settings a ``--resume`` compares (weights, device,
seed, context length, sampling defaults): the merged file states one run's
settings, so traces of other runs would be labelled with settings they were
not recorded with.  ``mixed_settings`` merges traces whose sampling settings
and seed differ: each request keeps its own (``sampling_params``), and the
merged file states no run-wide ones.  Requests are copied shard by shard in
record order through the ordinary writer, so the merged file has fresh
checksums and the layout of a single recording; where each request came
from is kept in the root attribute ``merged_from``.
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
from moetrace.trace.records import LOGPROBS, ROUTED_WEIGHTS
from moetrace.trace.resume import ADDED_LATER, DEFAULT_KEYS, SETTING_NAMES, result_settings
from moetrace.trace.verify import PARTIAL_MERGE
from moetrace.trace.writer import TraceWriter

MUST_MATCH = (
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
    "format_version",  # after the optional arrays, which decide it and are named on their own
)
# The optional arrays, and the option that records each.
OPTIONAL_ARRAYS = {ROUTED_WEIGHTS: "--record-weights", LOGPROBS: "--logprobs"}
# Settings (trace/resume.py) that only decide how tokens are sampled: with mixed_settings
# they may differ, each request keeping its own.
SAMPLING_SETTINGS = (*DEFAULT_KEYS, "sampling_seed", "seed")


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


def _array_problem(first: Trace, shard: Trace) -> str | None:
    """How the two differ in the optional arrays they hold, in the user's words, or None."""
    for name, option in OPTIONAL_ARRAYS.items():
        holders = [t.path for t in (first, shard) if name in t.arrays]
        if len(holders) == 1:
            lacking = shard.path if holders[0] == first.path else first.path
            return f"{holders[0]} holds {name} and {lacking} does not (recorded without {option})"
    if first.weights_dtype != shard.weights_dtype:
        return (
            f"routed_weights are {shard.weights_dtype} in {shard.path} and "
            f"{first.weights_dtype} in {first.path} (--weights-dtype)"
        )
    return None


def run_settings(trace: Trace) -> dict:
    """The settings a ``--resume`` of the trace would have to match (trace/resume.py)."""
    md = trace.metadata
    return result_settings(
        str(md.get("config_digest", "")), str(md.get("dtype", "")), md.get("engine_settings") or {}
    )


def _settings_problem(first: Trace, shard: Trace, mixed_settings: bool) -> str | None:
    """The first setting that says the two are not shards of one run, or None."""
    a, b = run_settings(first), run_settings(shard)
    for key in a:
        if key in ADDED_LATER and None in (a[key], b[key]):
            continue  # a trace written before the setting was kept
        if a[key] == b[key] or (mixed_settings and key in SAMPLING_SETTINGS):
            continue
        name = SETTING_NAMES.get(key, key)
        hint = " (--mixed-settings merges them, each request keeping its own settings)"
        return f"{name} {_show(b[key])} in {shard.path} and {_show(a[key])} in {first.path}" + (
            hint if key in SAMPLING_SETTINGS else ""
        )
    return None


def check_shards(
    shards: Sequence[Trace], allow_incomplete: bool = False, mixed_settings: bool = False
) -> tuple[list, list]:
    """Refuse shards that cannot be one recording.

    Returns (notes about harmless differences, reasons the merged trace is
    partial: shards of the split not given, shards whose recording did not finish).
    """
    first = shards[0]
    notes = []
    for shard in shards[1:]:
        problem = _array_problem(first, shard)
        for key in MUST_MATCH:
            a, b = first.metadata.get(key), shard.metadata.get(key)
            if problem is None and a != b:
                problem = f"{key} {b!r} vs {a!r}"
        problem = problem or _settings_problem(first, shard, mixed_settings)
        if problem is not None:
            raise MoetraceError(
                f"{shard.path} is not a shard of the same recording as {first.path}: {problem}"
            )
        if shard.metadata.get("model") != first.metadata.get("model"):
            notes.append(
                f"model given as {shard.metadata['model']!r} in {shard.path} and "
                f"{first.metadata['model']!r} in {first.path} (same config digest)"
            )
    if mixed_settings:
        lacking = next((s for s in shards if "sampling_params" not in s.requests.dtype.names), None)
        if lacking is not None:
            raise MoetraceError(
                f"{lacking.path} was written before requests kept their own sampling settings: "
                "merged with --mixed-settings its requests would carry none; merge it only with "
                "traces recorded with the same settings"
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
    mixed_settings: bool = False,
) -> dict:
    """Write ``output`` from ``shard_paths``; returns counts, notes and why it is partial.

    A merge that lacks shards of the split, or holds a shard whose recording
    did not finish, is closed incomplete (``verify`` says so) unless
    ``as_complete``: the user says the subset is what they want.
    ``mixed_settings``: traces of runs with other sampling settings (module docstring).
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
        notes, partial = check_shards(shards, allow_incomplete, mixed_settings)
        # Written beside OUT and renamed over it only when every shard went in: a damaged
        # shard must not cost the user the file that --overwrite was to replace.
        with replacing(out) as temporary:
            provenance, requests, rows, complete = _write_merged(
                temporary, shards, partial, as_complete, lock, mixed_settings
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
    path: Path,
    shards: list[Trace],
    partial: list[str],
    as_complete: bool,
    lock: TraceLock,
    mixed_settings: bool,
) -> tuple[list[dict], int, int, bool]:
    """Copy every shard's requests into a new trace at ``path``; provenance and counts."""
    first = shards[0]
    metadata = metadata_of(first)
    if mixed_settings:  # no run-wide sampling settings: each request states its own
        settings = dict(metadata.engine_settings)
        for key in ("sampling_defaults", "seed"):
            settings.pop(key, None)
        metadata.engine_settings = {**settings, "mixed_settings": True}
    writer = TraceWriter(
        path,
        metadata,
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


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)
