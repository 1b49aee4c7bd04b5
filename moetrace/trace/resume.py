"""May this run continue that trace, and what does the trace already hold?

A resumed file must equal one uninterrupted run's, request by request.  So
the settings that change what a request records must match the trace's:
the model (config digest and a sampled digest of the weights), compute
dtype, device, load format, run seed, context length and the sampling
defaults.  Settings that only change how the engine batches
(``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``,
``--num-kv-blocks``, prefix caching, memory share) may differ: rows and
tokens are invariant to them, which tests/engine/test_llm_engine_invariance.py proves
bit for bit.

The trace's records must also be sound: every record's offsets and lengths
are checked (the table only), and the tail is checked against its data as the
reader does for any incomplete file; records past the last sound one are cut
off and redone (``reopen_for_append``, which the writer calls).  Full
checksums of every row are ``moetrace verify``'s job.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.checked_rows import DamagedTraceError
from moetrace.trace.integrity import record_crc
from moetrace.trace.metadata import LIBVER, TraceMetadata, utc_now
from moetrace.trace.reader import Trace
from moetrace.trace.records import ARRAYS, REQUESTS, ROWS, FlatArray, table_columns

# Setting -> how the user names it; the sampling defaults are compared one by one.
SETTING_NAMES = {
    "config_digest": "model config (config.json digest)",
    "weights_digest": "model weights (sampled digest of the safetensors files)",
    "dtype": "--dtype",
    "device": "--device",
    "load_format": "--load-format",
    "seed": "--seed",
    "max_model_len": "--max-model-len (effective context)",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "ignore_eos": "--ignore-eos",
    "stop_token_ids": "default stop_token_ids",
    "sampling_seed": "default sampling seed",
    "min_p": "default min_p (generation config)",
    "repetition_penalty": "default repetition_penalty (generation config)",
}
# The sampling defaults a resume compares (a prompt line's own values are in the trace's prompts).
DEFAULT_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
)


def result_settings(config_digest: str, dtype: str, engine_settings: dict) -> dict:
    """The settings a resume must match, from a trace's (or a run's) metadata."""
    sampling = dict(engine_settings.get("sampling_defaults") or {})
    settings = {
        "config_digest": config_digest,
        "dtype": dtype,
        "device": engine_settings.get("device"),
        "load_format": engine_settings.get("load_format"),
        "weights_digest": engine_settings.get("weights_digest"),
        "seed": engine_settings.get("seed"),
        "max_model_len": engine_settings.get("max_model_len"),
    }
    for key in DEFAULT_KEYS:
        settings[key] = sampling.get(key)
    settings["sampling_seed"] = sampling.get("seed")
    # JSON round trip: a run's own values compare equal to what a file stored.
    return json.loads(json.dumps(settings))


def prompt_crc(token_ids) -> int:
    """CRC-32 of a prompt as little-endian int32: the same prompt, whatever produced it."""
    return zlib.crc32(np.ascontiguousarray(token_ids, dtype="<i4").tobytes())


@dataclass
class ResumePoint:
    """What an existing trace holds, once it has been accepted for a resume."""

    path: Path
    keep_requests: int  # sound records kept; anything after them is cut off
    dropped: int  # tail records not backed by data (redone)
    prompts: dict[str, int] = field(default_factory=dict)  # id -> prompt_crc
    samples: dict[str, set[int]] = field(default_factory=dict)  # id -> sample indices held
    skipped_inputs: list[dict] = field(default_factory=list)
    was_complete: bool = False
    settings: dict = field(default_factory=dict)  # result_settings of the trace

    def check_prompt(self, request_id: str, token_ids, where: str) -> set[int]:
        """The samples of the request already recorded (none: an empty set).

        Refuses a request recorded with another prompt.
        """
        crc = self.prompts.get(request_id)
        if crc is None:
            return set()
        if crc != prompt_crc(token_ids):
            raise MoetraceError(
                f"cannot resume {self.path}: request {request_id!r} ({where}) was recorded with "
                "another prompt; resume with the same prompts"
            )
        return self.samples.get(request_id, set())


# Settings that traces written before they existed lack: not compared with those.
ADDED_LATER = {"weights_digest", "min_p", "repetition_penalty"}


def mismatches(stored: dict, wanted: dict) -> list[str]:
    return [
        f"{SETTING_NAMES.get(key, key)} {_show(stored.get(key))} (this run: {_show(value)})"
        for key, value in wanted.items()
        if stored.get(key) != value and not (key in ADDED_LATER and stored.get(key) is None)
    ]


def check_settings(path: Path, stored: dict, wanted: dict) -> None:
    diff = mismatches(stored, wanted)
    if diff:
        raise MoetraceError(
            f"cannot resume {path}: it was recorded with {'; '.join(diff)} — settings that "
            "change the recorded rows must match (batching and cache settings may differ)"
        )


def open_resume_point(path: str | os.PathLike, wanted: dict) -> ResumePoint:
    """Check that ``path`` may be continued with settings ``wanted``; read what it holds."""
    path = Path(path)
    try:
        trace = Trace(path)
    except DamagedTraceError as exc:  # appending would bury the damage in a "complete" file
        raise MoetraceError(
            f"cannot resume {path}: it is damaged ({exc.problem}); run 'moetrace verify {path}'"
        ) from None
    with trace:
        md = trace.metadata
        stored = result_settings(
            str(md.get("config_digest", "")),
            str(md.get("dtype", "")),
            md.get("engine_settings") or {},
        )
        check_settings(path, stored, wanted)
        layout = trace.layout_problems()
        bad = next((i for i, problem in enumerate(layout) if problem), None)
        if bad is not None:
            raise MoetraceError(
                f"cannot resume {path}: request {bad} ({trace.request_ids[bad]!r}) is damaged "
                f"({layout[bad]}); run 'moetrace verify {path}'"
            )
        prompts: dict[str, int] = {}
        samples: dict[str, set[int]] = {}
        sample_of = iter(trace.sample_indices.tolist())
        for rid, tokens in trace.iter_prompt_tokens():
            sample = next(sample_of)
            if sample in samples.get(rid, ()):
                twice = f"request id {rid!r}" + (f" (sample {sample})" if sample else "")
                raise MoetraceError(f"cannot resume {path}: {twice} is in it twice")
            crc = prompt_crc(tokens)
            if prompts.setdefault(rid, crc) != crc:
                raise MoetraceError(
                    f"cannot resume {path}: the samples of request {rid!r} have other prompts"
                )
            samples.setdefault(rid, set()).add(sample)
        skipped = md["skipped_inputs"]
        return ResumePoint(
            path,
            keep_requests=trace.num_requests,
            dropped=trace.num_dropped,
            prompts=prompts,
            samples=samples,
            skipped_inputs=skipped,
            was_complete=trace.complete,
            settings=stored,
        )


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


@dataclass
class ReopenedTrace:
    """A trace reopened for appending, cut back to the records a resume keeps."""

    file: h5py.File
    columns: tuple  # of its request table (an older file's may end earlier)
    kept: int  # records kept
    row_end: int  # rows (and tokens) the kept records cover
    token_end: int
    table_crc: int


def reopen_for_append(
    path: Path,
    metadata: TraceMetadata,
    arrays: list[FlatArray],
    *,
    keep_requests: int | None,
    expected_requests: int | None,
) -> ReopenedTrace:
    """Open ``path`` for writing ``arrays`` after its first ``keep_requests`` records (all
    when None), cutting off anything after them; the table shrinks first, so a crash in
    between leaves records that still point at data."""
    f = h5py.File(path, "r+", libver=LIBVER, rdcc_nbytes=0)
    try:
        _check_appendable(f, metadata, arrays)
        table = f[REQUESTS]
        columns = table_columns(table.dtype)
        if columns is None:
            raise MoetraceError("its request table has other fields")
        n = table.shape[0] if keep_requests is None else min(table.shape[0], keep_requests)
        kept = table[:n]
        last = kept[-1] if n else None
        row_end = int(last["row_start"] + last["num_rows"]) if n else 0
        token_end = int(last["token_start"] + last["prompt_len"] + last["output_len"]) if n else 0
        resumes = json.loads(_attr_text(f.attrs.get("resumes", "[]")) or "[]")
        resumes.append(
            {
                "time": utc_now(),
                "kept_requests": n,
                "dropped_requests": int(table.shape[0]) - n,
                "moetrace_version": metadata.moetrace_version,
                "engine_settings": metadata.engine_settings,
            }
        )
        table_crc = record_crc(kept)
        f.attrs.update(complete=False, end_reason="recording")
        table.resize(n, axis=0)
        for array in arrays:
            f[array.name].resize(row_end if array.along == ROWS else token_end, axis=0)
        f.attrs.update(
            num_requests=n,
            num_rows=row_end,
            num_tokens=token_end,
            requests_crc32=table_crc,
            resumes=json.dumps(resumes, sort_keys=True),
        )
        # An appending run that does not say how many it expects makes the old count stale.
        f.attrs["expected_requests"] = -1 if expected_requests is None else expected_requests
        f.flush()
    except BaseException:
        f.close()
        raise
    return ReopenedTrace(f, columns, n, row_end, token_end, table_crc)


def _check_appendable(f: h5py.File, metadata: TraceMetadata, arrays: list[FlatArray]) -> None:
    """The file holds exactly the arrays this run writes, in its shapes and dtypes."""
    names = [a.name for a in arrays]
    missing = [name for name in (*names, REQUESTS) if name not in f]
    if missing:
        raise MoetraceError(f"it lacks dataset(s) {', '.join(missing)}")
    unwritten = [a.name for a in ARRAYS if a.name in f and a.name not in names]
    if unwritten:
        raise MoetraceError(f"it holds {', '.join(unwritten)}, which this run does not write")
    for array in arrays:
        ds, shape, dtype = f[array.name], array.shape(metadata), array.dtype(metadata)
        if ds.shape[1:] != shape or ds.dtype != dtype:
            raise MoetraceError(
                f"its {array.name} entries are {ds.dtype} {list(ds.shape[1:])}, "
                f"this run writes {dtype} {list(shape)}"
            )


def _attr_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
