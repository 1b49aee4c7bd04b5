"""Expert-load statistics against values computed by hand, independently of moetrace."""

from __future__ import annotations

import math
import statistics
from collections import Counter

import numpy as np
import pytest

from moetrace import open_trace
from moetrace.errors import MoetraceError
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.records import FinishedRequest
from moetrace.trace.stats import (
    counts_from_rows,
    expert_counts,
    load_stats,
    normalized_entropy,
    summary,
)
from moetrace.trace.writer import TraceWriter

COUNTS = np.array(
    [
        [4, 4, 4, 4],  # balanced
        [10, 0, 0, 2],  # skewed, two dead experts
        [0, 0, 0, 0],  # nothing routed
    ]
)


def test_load_stats_by_hand():
    s = load_stats(COUNTS)
    assert s.min.tolist() == [4, 0, 0]
    assert s.max.tolist() == [4, 10, 0]
    np.testing.assert_allclose(s.mean[:2], [4.0, 3.0])
    np.testing.assert_allclose(s.max_over_mean[:2], [1.0, 10 / 3])
    np.testing.assert_allclose(s.max_violation[:2], [0.0, (10 - 3) / 3])
    p = [10 / 12, 2 / 12]
    np.testing.assert_allclose(
        s.normalized_entropy[:2], [1.0, -sum(x * math.log(x) for x in p) / math.log(4)]
    )
    np.testing.assert_allclose(s.cv[:2], [0.0, statistics.pstdev([10, 0, 0, 2]) / 3])
    assert s.dead.tolist() == [0, 2, 4]
    assert s.mean[2] == 0  # an empty layer has no ratios
    for name in ("max_over_mean", "max_violation", "normalized_entropy", "cv"):
        assert np.isnan(getattr(s, name)[2]), name


def test_entropy_extremes():
    one_expert = np.array([[0, 7, 0, 0, 0, 0, 0, 0]])
    assert normalized_entropy(one_expert)[0] == 0
    assert normalized_entropy(np.full((1, 8), 3))[0] == pytest.approx(1.0)


def test_counts_from_rows_matches_a_plain_count():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 5, (37, 3, 2)).astype(np.uint8)
    want = np.zeros((3, 5), dtype=int)
    for row in rows.tolist():
        for layer, experts in enumerate(row):
            for e in experts:
                want[layer][e] += 1
    np.testing.assert_array_equal(counts_from_rows(rows, 5), want)
    with pytest.raises(MoetraceError, match="expert id 5"):
        counts_from_rows(np.full((1, 3, 2), 5, dtype=np.uint8), 5)


def planted_trace(path, num_experts: int = 300):
    """Layer l routes token t to experts (t + l) % E and (3 t) % E: counts follow by hand."""
    md = TraceMetadata(
        model="planted",
        architecture="PlantedMoe",
        config_digest="0" * 64,
        num_hidden_layers=2,
        moe_layer_indices=[0, 1],
        num_experts=num_experts,
        top_k=2,
        vocab_size=50,
    )
    lengths = [(5, 3, "stop"), (700, 0, "abort"), (40, 20, "length"), (1, 1, "stop")]
    reqs, expected = [], Counter()
    for i, (p, o, reason) in enumerate(lengths):
        n = p + o - 1 if reason != "abort" else 350
        t = np.arange(n)
        rows = np.stack(
            [np.stack([(t + layer) % num_experts, (3 * t) % num_experts], 1) for layer in (0, 1)], 1
        )
        for tok in range(n):
            for layer in (0, 1):
                expected[(layer, (tok + layer) % num_experts)] += 1
                expected[(layer, (3 * tok) % num_experts)] += 1
        reqs.append(
            FinishedRequest(
                request_id=f"r{i}",
                index=i,
                prompt_token_ids=np.zeros(p, np.int32),
                output_token_ids=np.ones(o, np.int32),
                routed_experts=rows.astype(md.expert_dtype),
                finish_reason=reason,
            )
        )
    with TraceWriter(path, md, chunk_rows=32) as w:
        for r in reqs:
            w.submit(r)
    want = np.zeros((2, num_experts), dtype=np.int64)
    for (layer, e), c in expected.items():
        want[layer, e] = c
    return reqs, want


def test_expert_counts_of_a_planted_trace(tmp_path):
    reqs, want = planted_trace(tmp_path / "t.h5")
    with open_trace(tmp_path / "t.h5") as t:
        for chunk_rows in (7, 32, 8192):
            np.testing.assert_array_equal(expert_counts(t, chunk_rows=chunk_rows), want)


def test_summary(tmp_path):
    reqs, _ = planted_trace(tmp_path / "t.h5")
    with open_trace(tmp_path / "t.h5") as t:
        s = summary(t)
    assert s == {
        "model": "planted",
        "architecture": "PlantedMoe",
        "layers": 2,
        "experts": 300,
        "top_k": 2,
        "requests": 4,
        "prompt_tokens": 5 + 700 + 40 + 1,
        "output_tokens": 3 + 0 + 20 + 1,
        "rows": 7 + 350 + 59 + 1,
        "file_size_bytes": (tmp_path / "t.h5").stat().st_size,
        "complete": True,
        "dropped_records": 0,
        "finish_reasons": {"stop": 2, "length": 1, "abort": 1},
        "arrays": {"routed_experts": "uint16", "token_ids": "int32"},  # 300 experts: uint16
    }
