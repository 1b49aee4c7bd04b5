"""diff: full agreement with itself, exactly the planted differences otherwise."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from support.analysis import LAYERS, E, metadata, planted_requests, write_trace
from typer.testing import CliRunner

from moetrace import open_trace
from moetrace.analysis.diff import diff_traces
from moetrace.cli.app import app
from moetrace.errors import MoetraceError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diff")
    reqs = planted_requests()
    b = copy.deepcopy(reqs)
    # 1. r1 token 5, column 2: one expert swapped for one outside the set.
    row = b[1].routed_experts[5, 2]
    outside = next(e for e in range(E) if e not in row)
    row[3] = outside
    # 2. r1 token 10, column 0: same set, first two swapped (top-1 differs, set does not).
    b[1].routed_experts[10, 0, [0, 1]] = b[1].routed_experts[10, 0, [1, 0]]
    # 3. r1 token 50 (output), columns 1 and 3: two experts each replaced.
    for col in (1, 3):
        row = b[1].routed_experts[50, col]
        fresh = [e for e in range(E) if e not in row][:2]
        row[2:] = fresh
    # 4. r4 generates different tokens from its 3rd output token: later rows are not compared,
    #    and a routing change there must not count.
    r4 = b[4]
    r4.output_token_ids = r4.output_token_ids.copy()
    r4.output_token_ids[2:] = (r4.output_token_ids[2:] + 1) % 300
    r4.routed_experts[r4.prompt_len + 5, 0] = (r4.routed_experts[r4.prompt_len + 5, 0] + 1) % E
    # 5. r13 is missing from b.
    del b[13]
    a_path = write_trace(tmp / "a.h5", reqs)
    b_path = write_trace(tmp / "b.h5", b)
    return reqs, a_path, b_path


def test_a_trace_agrees_with_itself(pair):
    reqs, a_path, _ = pair
    with open_trace(a_path) as a, open_trace(a_path) as a2:
        d = diff_traces(a, a2)
    assert d["identical"] is True
    assert d["token_mismatch"] == 0 and d["router_mismatch"] == 0
    assert d["mean_jaccard"] == 1.0
    assert d["tokens"] == sum(r.num_rows for r in reqs)
    assert d["rows_excluded"] == 0
    assert d["layers_differing_histogram"] == [d["tokens"], 0, 0, 0, 0]


@pytest.mark.parametrize("chunk", [7, 4096])
def test_planted_differences_exactly(pair, chunk, monkeypatch):
    monkeypatch.setattr("moetrace.analysis.diff.DIFF_CHUNK_ROWS", chunk)
    reqs, a_path, b_path = pair
    with open_trace(a_path) as a, open_trace(b_path) as b:
        d = diff_traces(a, b, detail_limit=0)
    r4 = reqs[4]
    compared_r4 = r4.prompt_len + 2  # tokens agree up to the 3rd output token
    total = sum(r.num_rows for r in reqs[:13]) - (r4.num_rows - compared_r4)
    assert d["identical"] is False
    assert d["tokens"] == total
    assert d["rows_excluded"] == r4.num_rows - compared_r4
    assert d["requests"]["only_in_a_ids"] == ["r13"] and d["requests"]["only_in_b"] == 0
    assert d["requests"]["tokens_diverged"] == 1 and d["requests"]["prompts_differ"] == 0
    # token 5 (one layer), token 50 (two layers) differ; token 10 only reorders
    assert d["tokens_with_difference"] == 2
    assert d["token_mismatch"] == pytest.approx(2 / total)
    assert d["router_mismatch"] == pytest.approx(3 / (total * 4))
    assert d["top1_mismatch"] == pytest.approx(1 / (total * 4))  # token 10 column 0
    jaccard_loss = (1 - 3 / 5) + 2 * (1 - 2 / 6)
    assert d["mean_jaccard"] == pytest.approx(1 - jaccard_loss / (total * 4))
    layers = {x["layer"]: x for x in d["layers"]}
    assert [layers[L]["set_differs"] for L in LAYERS] == [0, 1, 1, 1]
    assert [layers[L]["first_differing"] for L in LAYERS] == [0, 1, 1, 0]
    assert d["layers_differing_histogram"] == [total - 2, 1, 1, 0, 0]
    assert d["by_part"]["prompt"]["tokens_with_difference"] == 1  # token 5 of r1 (prompt 40)
    assert d["by_part"]["output"]["tokens_with_difference"] == 1
    detail = {x["id"]: x for x in d["request_detail"]}
    assert detail["r1"]["first_differing_token"] == 5
    assert detail["r1"]["tokens_with_difference"] == 2
    assert detail["r4"]["tokens_diverge_at"] == compared_r4
    assert detail["r4"]["compared_rows"] == compared_r4
    assert detail["r4"]["tokens_with_difference"] == 0
    assert set(detail) == {"r1", "r4"}  # only the requests that differ are listed


def test_match_by_index_and_refusals(pair, tmp_path):
    _, a_path, b_path = pair
    with open_trace(a_path) as a, open_trace(b_path) as b:
        assert diff_traces(a, b, match="index")["tokens_with_difference"] == 2
        sub = diff_traces(a, b, ids=["r0", "r1"])
        assert sub["requests"]["compared"] == 2 and sub["tokens_with_difference"] == 2
    other = write_trace(tmp_path / "o.h5", planted_requests(4), metadata(num_experts=32))
    with (
        open_trace(a_path) as a,
        open_trace(other) as o,
        pytest.raises(MoetraceError, match="num_experts"),
    ):
        diff_traces(a, o)


def test_diff_cli(pair, tmp_path):
    _, a_path, b_path = pair
    runner = CliRunner()
    res = runner.invoke(app, ["diff", str(a_path), str(b_path), "--json"])
    assert res.exit_code == 1, res.output  # different, as diff(1) says it
    d = json.loads(res.stdout)
    assert d["tokens_with_difference"] == 2
    res = runner.invoke(app, ["diff", str(a_path), str(b_path), "--plot", str(tmp_path / "d.png")])
    assert res.exit_code == 1, res.output
    assert "token mismatch" in res.stdout and "diverge" in res.stdout
    assert (tmp_path / "d.png").stat().st_size > 10_000
    same = runner.invoke(app, ["diff", str(a_path), str(a_path)])
    assert same.exit_code == 0 and "identical" in same.stdout


def test_unknown_tokens_compare_as_equal():
    from moetrace.analysis.diff import compared_rows
    from moetrace.trace.reader import TraceRequest

    def req(tokens, rows):
        return TraceRequest(
            request_id="x", index=0, prompt_token_ids=np.array(tokens[:2]),
            output_token_ids=np.array(tokens[2:]), routed_experts=np.zeros((rows, 1, 1)),
            finish_reason="stop", position=0, row_start=0, token_start=0, checksum=0,
        )  # fmt: skip

    # (rows compared, first differing token, one is a prefix of the other, unknown ids)
    assert compared_rows(req([1, 2, 3, 4], 3), req([-1, -1, -1, -1], 3)) == (3, None, False, True)
    assert compared_rows(req([1, 2, 3, 4], 3), req([1, 2, 9, 4], 3)) == (2, 2, False, False)
    assert compared_rows(req([1, 2, 3], 2), req([1, 2, 3, 4], 3)) == (2, None, True, False)
