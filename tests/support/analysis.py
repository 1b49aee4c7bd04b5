"""Traces with planted routing structure, and plain reference computations over them.

The references work on the list of ``FinishedRequest``s the trace was written
from, token by token with Python loops and Counters: a code path that shares
nothing with the streamed analysis under test.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter

LAYERS = [1, 2, 3, 5]  # decoder indices of the MoE layers (0 and 4 are dense)
E = 16
K = 4
VOCAB = 300
TOKEN_PLANT = 42  # at MoE column 1 this token's top-1 is always expert 7
PAIR_PLANT = (3, 5)  # at column 0 these two often come together


def metadata(**overrides) -> TraceMetadata:
    fields = dict(
        model="planted",
        architecture="PlantedMoeForCausalLM",
        config_digest="cd" * 32,
        num_hidden_layers=6,
        moe_layer_indices=LAYERS,
        num_experts=E,
        top_k=K,
        vocab_size=VOCAB,
        dtype="float32",
    )
    fields.update(overrides)
    return TraceMetadata(**fields)


def _pick(rng: np.random.Generator, probs: np.ndarray, first: int | None = None) -> list[int]:
    """k distinct experts from a skewed distribution, optionally with a given top-1."""
    chosen = [] if first is None else [first]
    while len(chosen) < K:
        e = int(rng.choice(E, p=probs))
        if e not in chosen:
            chosen.append(e)
    return chosen


def planted_requests(n: int = 14, seed: int = 0) -> list[FinishedRequest]:
    """Requests whose routing carries known structure on top of skewed random choices.

    - column 0: half the tokens select experts 3 and 5 together;
    - column 1: token 42 always routes first to expert 7; expert 15 is never chosen;
    - column 2: 60% of tokens repeat the previous token's experts exactly;
    - column 3: top-1 is column 2's top-1 plus one (a transition).
    """
    rng = np.random.default_rng(seed)
    probs = []
    for col in range(len(LAYERS)):
        w = rng.random(E) ** (col + 1) + 0.05
        if col == 1:
            w[15] = 0.0
        probs.append(w / w.sum())
    shapes = [(5, 3, "stop"), (40, 25, "length"), (1, 1, "stop"), (12, 0, "abort", 7)]
    shapes += [(int(rng.integers(1, 60)), int(rng.integers(0, 30)), "length") for _ in range(n - 6)]
    shapes += [(9, 4, "abort", 13), (3, 2, "stop")]
    reqs = []
    for i, shape in enumerate(shapes):
        p, o, reason = shape[:3]
        tokens = rng.integers(0, VOCAB, p + o).astype(np.int32)
        tokens[rng.random(p + o) < 0.15] = TOKEN_PLANT
        rows_n = shape[3] if len(shape) > 3 else p + o - 1
        rows = np.zeros((rows_n, len(LAYERS), K), dtype=np.uint8)
        for t in range(rows_n):
            if rng.random() < 0.5:
                rest = [e for e in _pick(rng, probs[0]) if e not in PAIR_PLANT][: K - 2]
                rows[t, 0] = [*PAIR_PLANT, *rest]
            else:
                rows[t, 0] = _pick(rng, probs[0])
            first = 7 if tokens[t] == TOKEN_PLANT else None
            rows[t, 1] = _pick(rng, probs[1], first)
            if t > 0 and rng.random() < 0.6:
                rows[t, 2] = rows[t - 1, 2]
            else:
                rows[t, 2] = _pick(rng, probs[2])
            rows[t, 3] = _pick(rng, probs[3], (int(rows[t, 2, 0]) + 1) % E)
        reqs.append(
            FinishedRequest(
                request_id=f"r{i}",
                index=i,
                prompt_token_ids=tokens[:p],
                output_token_ids=tokens[p:],
                routed_experts=rows,
                finish_reason=reason,
                num_cached_tokens=i % 3,
                num_preemptions=i % 2,
            )
        )
    return reqs


def write_trace(path: Path, reqs: list[FinishedRequest], md: TraceMetadata | None = None) -> Path:
    with TraceWriter(path, md or metadata(), chunk_rows=16) as w:
        for r in reqs:
            w.submit(r)
    return path


# -- reference computations ---------------------------------------------------------------


def token_rows(reqs, part: str = "all", ids=None):
    """(request, position, token, is_prompt, row) for every routing row, in trace order."""
    for r in reqs:
        if ids is not None and r.request_id not in ids:
            continue
        tokens = list(r.prompt_token_ids) + list(r.output_token_ids)
        for t in range(r.num_rows):
            is_prompt = t < r.prompt_len
            if part == "prompt" and not is_prompt or part == "output" and is_prompt:
                continue
            yield r, t, int(tokens[t]), is_prompt, r.routed_experts[t]


def ref_counts(reqs, part="all", ids=None) -> np.ndarray:
    c = np.zeros((len(LAYERS), E), dtype=np.int64)
    for *_, row in token_rows(reqs, part, ids):
        for col in range(len(LAYERS)):
            for e in row[col]:
                c[col, e] += 1
    return c


def ref_gini(x) -> float:
    x = [float(v) for v in x]
    n, mean = len(x), sum(x) / len(x)
    return sum(abs(a - b) for a in x for b in x) / (2 * n * n * mean)


def ref_entropy(x) -> float:
    total = sum(x)
    return -sum(v / total * np.log(v / total) for v in x if v) / np.log(len(x))


def ref_locality(reqs, part="all"):
    """Per column: pairs, top-1 repeats, set repeats, overlap sum; marginals for chance."""
    ncol = len(LAYERS)
    pairs = 0
    top1 = [0] * ncol
    sets = [0] * ncol
    overlap = [0] * ncol
    n = 0
    first = [Counter() for _ in range(ncol)]
    member = [Counter() for _ in range(ncol)]
    for r, t, _, _, row in token_rows(reqs, part):
        n += 1
        for col in range(ncol):
            first[col][int(row[col][0])] += 1
            member[col].update(int(e) for e in row[col])
        if t == 0:
            continue
        prev = r.routed_experts[t - 1]
        pairs += 1
        for col in range(ncol):
            top1[col] += int(row[col][0] == prev[col][0])
            sets[col] += int(set(row[col].tolist()) == set(prev[col].tolist()))
            overlap[col] += len(set(row[col].tolist()) & set(prev[col].tolist()))
    return pairs, top1, sets, overlap, n, first, member


def ref_coactivation(reqs, col: int) -> tuple[Counter, Counter, int]:
    pairs, members, n = Counter(), Counter(), 0
    for *_, row in token_rows(reqs):
        n += 1
        experts = sorted(int(e) for e in row[col])
        members.update(experts)
        for i in range(len(experts)):
            for j in range(i + 1, len(experts)):
                pairs[(experts[i], experts[j])] += 1
    return pairs, members, n


def ref_transitions(reqs, col: int) -> tuple[Counter, Counter]:
    sets, top1 = Counter(), Counter()
    for *_, row in token_rows(reqs):
        for a in row[col]:
            for b in row[col + 1]:
                sets[(int(a), int(b))] += 1
        top1[(int(row[col][0]), int(row[col + 1][0]))] += 1
    return sets, top1
