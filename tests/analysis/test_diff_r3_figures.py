"""R3's figures on a hand-worked example: two tiny traces, every number worked out by hand.

``diff`` and ``replay`` report the same figures (``replay`` is ``diff_traces`` of
the trace and its replay); here each one is a literal computed on paper from
the rows and log-probabilities below, not by code that mirrors the module.

Two MoE layers (decoder layers 1 and 3), 4 experts, top-2.  Rows of A and B
(layer 0 | layer 1), ``*`` where B's set differs from A's:

    x  t0  prompt   A 0 1 | 2 3    B 0 1 | 2 3
       t1  prompt   A 0 1 | 2 3    B 1 0 | 2 3     same sets, layer 0's top-1 differs
       t2  prompt   A 1 2 | 0 3    B 1 3*| 0 3     {1,2} vs {1,3}: Jaccard 1/3
       t3  output   A 3 0 | 1 2    B 3 0 | 1 2
       t4  output   A 2 0 | 1 3    B 2 1*| 1 3     {0,2} vs {1,2}: Jaccard 1/3
    y  t0  prompt   A 0 1 | 0 1    B 0 1 | 0 1
       t1  prompt   A 2 3 | 2 3    B 2 3 | 3 2     same sets, layer 1's top-1 differs
       t2  output   A 0 2 | 1 3    B 0 2 | 0 2*    {1,3} vs {0,2}: Jaccard 0

Output log-probabilities, ``d = log p_B - log p_A``: x: 0, +1, -1; y: +0.5, -2.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from support.cli import moetrace

from moetrace import open_trace
from moetrace.analysis.diff import diff_traces
from moetrace.trace.metadata import TraceMetadata
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter

ROWS = {
    "x": (
        [[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]], [[2, 0], [1, 3]]],
        [[[0, 1], [2, 3]], [[1, 0], [2, 3]], [[1, 3], [0, 3]], [[3, 0], [1, 2]], [[2, 1], [1, 3]]],
    ),
    "y": (
        [[[0, 1], [0, 1]], [[2, 3], [2, 3]], [[0, 2], [1, 3]]],
        [[[0, 1], [0, 1]], [[2, 3], [3, 2]], [[0, 2], [0, 2]]],
    ),
}
TOKENS = {"x": ([10, 11, 12], [20, 21, 22]), "y": ([30, 31], [40, 41])}
LOGPROBS = {"x": ([-0.5, -2.0, -1.5], [-0.5, -1.0, -2.5]), "y": ([-1.0, -3.0], [-0.5, -5.0])}


def write(path, side: int) -> str:
    md = TraceMetadata(
        model="hand",
        architecture="HandMoeForCausalLM",
        config_digest="ab" * 32,
        num_hidden_layers=4,
        moe_layer_indices=[1, 3],
        num_experts=4,
        top_k=2,
        vocab_size=64,
        dtype="float32",
        logprobs=True,
    )
    with TraceWriter(path, md) as w:
        for i, rid in enumerate(ROWS):
            prompt, output = TOKENS[rid]
            w.submit(
                FinishedRequest(
                    request_id=rid,
                    index=i,
                    prompt_token_ids=np.array(prompt, dtype=np.int32),
                    output_token_ids=np.array(output, dtype=np.int32),
                    routed_experts=np.array(ROWS[rid][side], dtype=np.uint8),
                    finish_reason="length",
                    output_logprobs=np.array(LOGPROBS[rid][side], dtype=np.float32),
                )
            )
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("r3")
    return write(tmp / "a.h5", 0), write(tmp / "b.h5", 1)


def test_routing_figures_by_hand(pair):
    with open_trace(pair[0]) as a, open_trace(pair[1]) as b:
        d = diff_traces(a, b)
    assert d["tokens"] == 8 and d["tokens_with_difference"] == 3  # x t2, x t4, y t2
    assert d["token_mismatch"] == 3 / 8
    assert d["router_mismatch"] == 3 / 16  # 3 of 8 tokens x 2 layers
    assert d["top1_mismatch"] == 3 / 16  # x t1 layer 0; y t1 and y t2 layer 1
    assert d["mean_jaccard"] == pytest.approx((13 + 1 / 3 + 1 / 3 + 0) / 16)
    layers = d["layers"]
    assert [x["layer"] for x in layers] == [1, 3]
    assert [x["set_differs"] for x in layers] == [2, 1]
    assert [x["set_mismatch"] for x in layers] == [2 / 8, 1 / 8]
    assert [x["top1_mismatch"] for x in layers] == [1 / 8, 2 / 8]
    assert layers[0]["mean_jaccard"] == pytest.approx((6 + 2 / 3) / 8)
    assert layers[1]["mean_jaccard"] == pytest.approx(7 / 8)
    assert [x["first_differing"] for x in layers] == [2, 1]
    assert d["layers_differing_histogram"] == [5, 3, 0]
    prompt, output = d["by_part"]["prompt"], d["by_part"]["output"]
    assert (prompt["tokens"], prompt["tokens_with_difference"]) == (5, 1)
    assert (output["tokens"], output["tokens_with_difference"]) == (3, 2)
    assert output["router_mismatch"] == 2 / 6


def test_logprob_figures_by_hand(pair):
    with open_trace(pair[0]) as a, open_trace(pair[1]) as b:
        lp = diff_traces(a, b)["logprobs"]
    assert lp["tokens"] == 5
    assert lp["mean_abs_logprob_diff"] == pytest.approx((0 + 1 + 1 + 0.5 + 2) / 5)
    assert lp["max_abs_logprob_diff"] == 2.0
    assert lp["kl_k1"] == pytest.approx(-(0 + 1 - 1 + 0.5 - 2) / 5)  # mean of -d
    # mean of e^d - 1 - d over d = 0, 1, -1, 0.5, -2
    k3 = (0 + (math.e - 2) + math.exp(-1) + (math.exp(0.5) - 1.5) + (math.exp(-2) + 1)) / 5
    assert lp["kl_k3"] == pytest.approx(k3) and lp["kl_k3"] == pytest.approx(0.4740435646)
    # |d| > ln 2: d = 1, -1, -2; B over A: d = 1; A over B: d = -1, -2
    assert lp["ratio_above_2"] == 3 / 5
    assert (lp["ratio_b_over_a_above_2"], lp["ratio_a_over_b_above_2"]) == (1 / 5, 2 / 5)
    # tau 1.5: |d| > 0.405 (all but 0); 5: > 1.609 (only -2); 10: > 2.303 (none)
    assert lp["tail"] == {"1.5": 4 / 5, "2": 3 / 5, "5": 1 / 5, "10": 0.0}


def test_the_printed_report_states_the_figures(pair):
    """The tables ``diff`` prints, which ``replay`` prints too (same renderer)."""
    proc = moetrace("diff", *pair)
    assert proc.returncode == 1, proc.stderr
    out = " ".join(proc.stdout.split())
    for line in (
        "routing differs at 3 of the 8 tokens compared",
        "token mismatch 37.50% (any layer's top-k set differs)",
        "router mismatch 18.75%",
        "top-1 mismatch 18.75%",
        "mean Jaccard 0.8542",  # (13 + 2/3) / 16
        "log-probs 5 output tokens: mean |d| 9.00e-01, max 2.00e+00",
        "KL(A || B) k3 4.740e-01, k1 3.000e-01",
        "ratio > 2 60.00% of tokens",
        "1 2 25.00% 12.50% 0.8333 2",  # per layer: layer, set differs, share, top-1, Jaccard, first
        "3 1 12.50% 25.00% 0.8750 1",
    ):
        assert line in out, line
    doc = json.loads(moetrace("diff", *pair, "--json").stdout)
    assert doc["logprobs"]["ratio_above_2"] == 3 / 5
