"""Traces written by an earlier moetrace, kept in tests/data/, and what they hold.

The files were written once, by the code of commit 017d5e7 (before the request
record schema moved to ``trace/records.py``), by running this module:

    .venv/bin/python tests/support/legacy_traces.py

Do not regenerate them with newer code: they are here so that a test notices
when a change to the writer or the reader leaves files written before it
unreadable.  ``expected_requests`` rebuilds their contents from the seeds, so
the test compares against numbers, not against another read of the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"

# name: (num_experts, moe layers, top_k, compression, requests before the resume, total)
LEGACY_TRACES = {
    "trace_v1_uint8.h5": (64, 3, 4, None, None, 9),
    "trace_v1_uint16_gzip_resumed.h5": (300, 2, 3, "gzip", 5, 8),
}
REASONS = ("stop", "length", "abort", "stop", "length", "abort", "stop", "stop", "length")


def legacy_metadata_fields(name: str) -> dict:
    """The TraceMetadata arguments a legacy file was written with."""
    num_experts, layers, top_k, *_ = LEGACY_TRACES[name]
    return {
        "model": f"legacy/{name}",
        "architecture": "LegacyMoeForCausalLM",
        "config_digest": "cd" * 32,
        "num_hidden_layers": layers + 1,
        "moe_layer_indices": list(range(1, layers + 1)),
        "num_experts": num_experts,
        "top_k": top_k,
        "vocab_size": 500,
        "tokenizer": None,
        "dtype": "bfloat16",
        "engine_settings": {"block_size": 16, "seed": 7},
        "moetrace_version": "0.1.0",
    }


def expected_requests(name: str) -> list[dict]:
    """Every request of a legacy file, as plain values and numpy arrays, in record order."""
    num_experts, layers, top_k, _, _, total = LEGACY_TRACES[name]
    id_dtype = np.uint8 if num_experts <= 256 else np.uint16
    rng = np.random.default_rng(sum(map(ord, name)))
    out = []
    for i in range(total):
        prompt_len, output_len = int(rng.integers(1, 40)), int(rng.integers(0, 12))
        reason = REASONS[i]
        if reason == "stop" and output_len == 0:
            output_len = 1
        tokens = prompt_len + output_len
        rows = tokens - 1 if reason != "abort" else int(rng.integers(0, tokens + 1))
        out.append(
            {
                "request_id": f"légacy-{i}" if i % 3 else str(i),
                "index": (i * 5) % total,
                "prompt_token_ids": rng.integers(0, 500, prompt_len).astype(np.int32),
                "output_token_ids": rng.integers(0, 500, output_len).astype(np.int32),
                "routed_experts": rng.integers(0, num_experts, (rows, layers, top_k)).astype(
                    id_dtype
                ),
                "finish_reason": reason,
                "num_cached_tokens": int(rng.integers(0, prompt_len + 1)),
                "num_preemptions": i % 3,
                "extra": {"turn": i, "note": "ü"} if i % 2 else {},
            }
        )
    return out


def _write_all() -> None:  # pragma: no cover - run by hand, once
    from moetrace.trace.metadata import TraceMetadata
    from moetrace.trace.records import FinishedRequest
    from moetrace.trace.writer import TraceWriter

    DATA.mkdir(exist_ok=True)
    for name, (_, _, _, compression, first, total) in LEGACY_TRACES.items():
        path = DATA / name
        md = TraceMetadata(**legacy_metadata_fields(name))
        reqs = [FinishedRequest(**r) for r in expected_requests(name)]
        options = {"chunk_rows": 16, "compression": compression}
        split = first if first is not None else total
        with TraceWriter(path, md, overwrite=True, expected_requests=total, **options) as w:
            for req in reqs[:split]:
                w.submit(req)
        if split < total:
            writer = TraceWriter(path, md, append=True, **options).start()
            for req in reqs[split:]:
                writer.submit(req)
            writer.close()
        print(path, path.stat().st_size)


if __name__ == "__main__":
    _write_all()
