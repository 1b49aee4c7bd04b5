"""Synthetic trace metadata and finished requests for the writer, reader and resume tests."""

from __future__ import annotations

import numpy as np

from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.records import FinishedRequest

CHUNK = 64  # small chunks so that a few dozen requests cross many chunk boundaries


def make_metadata(num_experts: int = 64, layers: int = 3, top_k: int = 4) -> TraceMetadata:
    return TraceMetadata(
        model="test/model",
        architecture="TestMoeForCausalLM",
        config_digest="ab" * 32,
        num_hidden_layers=layers + 1,
        moe_layer_indices=list(range(1, layers + 1)),
        num_experts=num_experts,
        top_k=top_k,
        vocab_size=1000,
        engine_settings={"max_num_seqs": 8, "block_size": 16},
        moetrace_version="9.9.9",
    )


def make_request(
    rng: np.random.Generator,
    md: TraceMetadata,
    i: int,
    prompt_len: int,
    output_len: int,
    reason: str = "stop",
    rows: int | None = None,
) -> FinishedRequest:
    if rows is None:
        rows = prompt_len + output_len - 1
    return FinishedRequest(
        request_id=f"req-{i}-é",
        index=i,
        prompt_token_ids=rng.integers(0, 1000, prompt_len).astype(np.int32),
        output_token_ids=rng.integers(0, 1000, output_len).astype(np.int32),
        routed_experts=rng.integers(0, md.num_experts, (rows, md.num_moe_layers, md.top_k)).astype(
            md.expert_dtype
        ),
        finish_reason=reason,
        num_cached_tokens=int(rng.integers(0, prompt_len + 1)),
        num_preemptions=i % 3,
        extra={"custom": i} if i % 2 else {},
    )


def mixed_requests(md: TraceMetadata, n: int = 40, seed: int = 0) -> list[FinishedRequest]:
    """Random lengths, some longer than several chunks, zero outputs, aborts with fewer rows."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        p, o = int(rng.integers(1, 50)), int(rng.integers(0, 20))
        kind = i % 6
        if kind == 0:
            p = int(rng.integers(3 * CHUNK, 5 * CHUNK))
        if kind == 1:
            reqs.append(make_request(rng, md, i, p, 0, "abort", rows=int(rng.integers(0, p))))
        elif kind == 2:
            reqs.append(make_request(rng, md, i, p, o, "abort", rows=int(rng.integers(0, p + o))))
        elif kind == 3:
            reqs.append(make_request(rng, md, i, p, max(o, 1), "length"))
        else:
            reqs.append(make_request(rng, md, i, p, o, "stop" if o or p > 1 else "length"))
    return reqs
