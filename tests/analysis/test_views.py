"""Every inspect figure on a planted trace equals a plain reference computed in the test."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from support.analysis import (
    LAYERS,
    PAIR_PLANT,
    TOKEN_PLANT,
    E,
    K,
    planted_requests,
    ref_coactivation,
    ref_counts,
    ref_entropy,
    ref_gini,
    ref_locality,
    ref_transitions,
    token_rows,
    write_trace,
)

from moetrace import open_trace
from moetrace.analysis.balance import gini
from moetrace.analysis.ep import contiguous_map, expert_map, round_robin_map
from moetrace.analysis.load import RowStream, Selection, select_columns, select_positions
from moetrace.analysis.report import InspectOptions, inspect_report
from moetrace.errors import MoetraceError

CHUNKS = (7, 64, 16384)  # across request boundaries, across file chunks, whole trace


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    reqs = planted_requests()
    path = write_trace(tmp_path_factory.mktemp("planted") / "t.h5", reqs)
    with open_trace(path) as trace:
        yield reqs, trace


def report(trace, **kw) -> dict:
    return inspect_report(trace, InspectOptions(**kw))


def test_the_plants_are_there(planted):
    reqs, _ = planted
    counts = ref_counts(reqs)
    assert counts[1, 15] == 0  # dead expert
    tok = [row for _, _, token, _, row in token_rows(reqs) if token == TOKEN_PLANT]
    assert tok and all(row[1][0] == 7 for row in tok)
    assert sum(1 for r in reqs if r.finish_reason == "abort") == 2


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("ids", [None, ["r1", "r2", "r3", "r7", "r11"]])
def test_rows_stream_with_their_context(planted, chunk, ids):
    """Whole trace through iter_row_chunks; a subset by offsets (adjacent requests merged)."""
    reqs, trace = planted
    want = list(token_rows(reqs, ids=None if ids is None else set(ids)))
    selection = Selection(None if ids is None else select_positions(trace, ids))
    got = []
    for block in RowStream(trace, selection, chunk_rows=chunk):
        assert len(block) <= chunk
        for i in range(len(block)):
            got.append(
                (
                    int(block.request[i]),
                    int(block.position[i]),
                    int(block.tokens[i]),
                    bool(block.is_prompt[i]),
                    block.rows[i].tolist(),
                    block.prev_rows[i].tolist() if block.has_prev[i] else None,
                )
            )
    assert len(got) == len(want)
    for g, (r, t, token, is_prompt, row) in zip(got, want, strict=True):
        prev = r.routed_experts[t - 1].tolist() if t > 0 else None
        assert g == (r.index, t, token, is_prompt, row.tolist(), prev)


@pytest.mark.parametrize("part", ["all", "prompt", "output"])
@pytest.mark.parametrize("chunk", (7, 16384))
def test_load_figures(planted, part, chunk):
    reqs, trace = planted
    r = report(trace, part=part, chunk_rows=chunk)
    counts = ref_counts(reqs, part)
    assert r["expert_counts"] == counts.tolist()
    for col in range(len(LAYERS)):
        total = counts[col].sum()
        assert r["expert_shares"][col] == pytest.approx([c / total for c in counts[col]], abs=1e-6)
    assert r["selection"]["rows"] == sum(1 for _ in token_rows(reqs, part))
    for col, row in enumerate(r["layer_load"]):
        c = counts[col].tolist()
        mean = sum(c) / E
        assert row["layer"] == LAYERS[col]
        assert row["assignments"] == sum(c)
        assert (row["min"], row["max"]) == (min(c), max(c))
        assert row["mean"] == pytest.approx(mean)
        assert row["max_over_mean"] == pytest.approx(max(c) / mean)
        assert row["max_violation"] == pytest.approx((max(c) - mean) / mean)
        sd = math.sqrt(sum((x - mean) ** 2 for x in c) / E)
        assert row["cv"] == pytest.approx(sd / mean)
        assert row["gini"] == pytest.approx(ref_gini(c))
        assert row["normalized_entropy"] == pytest.approx(ref_entropy(c))
        assert row["dead_experts"] == c.count(0)
        assert row["top_expert"] == c.index(max(c))
        assert row["top_share"] == pytest.approx(max(c) / sum(c))
    assert r["layer_load"][1]["dead_experts"] >= 1
    if part == "all":
        prompt, output = ref_counts(reqs, "prompt"), ref_counts(reqs, "output")
        for col, pvo in enumerate(r["prompt_vs_output"]):
            tv = 0.5 * sum(
                abs(a / prompt[col].sum() - b / output[col].sum())
                for a, b in zip(prompt[col], output[col], strict=True)
            )
            assert pvo["total_variation"] == pytest.approx(tv)
            pm = prompt[col].sum() / E
            assert pvo["prompt_max_violation"] == pytest.approx((prompt[col].max() - pm) / pm)


def test_gini_extremes():
    assert gini(np.array([[5, 5, 5, 5]]))[0] == 0
    assert gini(np.array([[0, 0, 0, 8]]))[0] == pytest.approx(3 / 4)


def test_request_subset_and_layers(planted):
    reqs, trace = planted
    ids = {"r1", "r4", "r5", "r9"}
    r = report(trace, request_ids=["r1", "r9"], ranges=["4:6"], layers=[2, 5])
    assert r["selection"]["requests"] == 4
    assert r["selection"]["layers"] == [2, 5]
    counts = ref_counts(reqs, ids=ids)
    assert r["expert_counts"] == counts[[1, 3]].tolist()
    # a glob picks the same requests as the ids
    g = report(trace, request_ids=["r[19]"], ranges=["4:6"], layers=[2, 5])
    assert g["expert_counts"] == r["expert_counts"]


def test_selection_errors(planted):
    _, trace = planted
    with pytest.raises(MoetraceError, match="no request with id 'nope'"):
        select_positions(trace, ["nope"])
    with pytest.raises(MoetraceError, match="layer 0 does not route"):
        select_columns(trace, [0])
    with pytest.raises(MoetraceError, match="bad request range"):
        select_positions(trace, ranges=["a:b"])
    with pytest.raises(MoetraceError, match="part must be"):
        Selection(part="decode")
    assert select_positions(trace, ranges=["-2:"]).tolist() == [12, 13]


@pytest.mark.parametrize("placement", ["contiguous", "round-robin"])
def test_expert_parallel_balance(planted, placement):
    reqs, trace = planted
    ep = 3  # 16 experts over 3 ranks: 6, 5, 5 contiguous
    rank_of = contiguous_map(E, ep) if placement == "contiguous" else round_robin_map(E, ep)
    r = report(trace, ep_size=ep, ep_placement=placement, chunk_rows=7)["ep"]
    for col, layer in enumerate(r["layers"]):
        load = [0] * ep
        hist = [0] * (K + 1)
        for *_, row in token_rows(reqs):
            ranks = {int(rank_of[e]) for e in row[col]}
            for e in row[col]:
                load[rank_of[e]] += 1
            hist[len(ranks)] += 1
        mean = sum(load) / ep
        assert layer["rank_load"] == load
        assert layer["max_over_mean"] == pytest.approx(max(load) / mean)
        assert layer["busiest_rank"] == load.index(max(load))
        assert layer["ranks_per_token_histogram"] == hist
        assert layer["mean_ranks_per_token"] == pytest.approx(
            sum(i * h for i, h in enumerate(hist)) / sum(hist)
        )


def test_expert_maps(tmp_path):
    assert contiguous_map(16, 3).tolist() == [0] * 6 + [1] * 5 + [2] * 5
    assert round_robin_map(5, 2).tolist() == [0, 1, 0, 1, 0]
    f = tmp_path / "map.json"
    f.write_text("[[0,1,0,1],[1,1,0,0]]")
    assert expert_map(2, 4, map_file=f).tolist() == [[0, 1, 0, 1], [1, 1, 0, 0]]
    f.write_text("[0,1,2]")
    with pytest.raises(MoetraceError, match="shape"):
        expert_map(2, 4, map_file=f)
    with pytest.raises(MoetraceError, match="more ranks"):
        expert_map(2, 4, ep_size=8)


def test_ep_from_a_map_file(planted, tmp_path):
    reqs, trace = planted
    per_layer = [[(e * (c + 1)) % 4 for e in range(E)] for c in range(len(LAYERS))]
    f = tmp_path / "eplb.json"
    f.write_text(str(per_layer))
    r = report(trace, ep_map=f, layers=[3])["ep"]
    load = [0] * 4
    for *_, row in token_rows(reqs):
        for e in row[2]:
            load[per_layer[2][e]] += 1
    assert r["layers"][0]["rank_load"] == load


@pytest.mark.parametrize("part", ["all", "output"])
def test_temporal_locality(planted, part):
    reqs, trace = planted
    pairs, top1, sets, overlap, n, first, member = ref_locality(reqs, part)
    got = report(trace, views=["locality"], part=part, chunk_rows=7)["locality"]
    for col, g in enumerate(got):
        assert g["pairs"] == pairs
        assert g["top1_repeat"] == pytest.approx(top1[col] / pairs)
        assert g["set_repeat"] == pytest.approx(sets[col] / pairs)
        assert g["overlap"] == pytest.approx(overlap[col] / (pairs * K))
        chance = sum((c / n) ** 2 for c in first[col].values())
        assert g["top1_chance"] == pytest.approx(chance)
        assert g["top1_lift"] == pytest.approx(top1[col] / pairs / chance)
        ov_chance = sum((c / n) ** 2 for c in member[col].values()) / K
        assert g["overlap_chance"] == pytest.approx(ov_chance)
    # the planted repeat layer stands out
    assert got[2]["set_repeat"] > 0.45 > got[0]["set_repeat"]


def test_coactivation_pairs(planted):
    reqs, trace = planted
    got = report(trace, views=["coactivation"], top=400, chunk_rows=64)["coactivation"]
    for col, g in enumerate(got):
        pairs, members, n = ref_coactivation(reqs, col)
        assert {(p["a"], p["b"]): p["count"] for p in g["pairs"]} == dict(pairs)
        for p in g["pairs"]:
            assert p["lift"] == pytest.approx(p["count"] * n / (members[p["a"]] * members[p["b"]]))
            assert p["share"] == pytest.approx(p["count"] / n)
        counts = [p["count"] for p in g["pairs"]]
        assert counts == sorted(counts, reverse=True)
    top = report(trace, views=["coactivation"], top=1)["coactivation"][0]["pairs"][0]
    assert (top["a"], top["b"]) == PAIR_PLANT


def test_coactivation_by_lift(planted):
    reqs, trace = planted
    got = report(trace, views=["coactivation"], top=3, rank_by="lift")["coactivation"][0]
    pairs, members, n = ref_coactivation(reqs, 0)
    lifts = sorted((c * n / (members[a] * members[b]) for (a, b), c in pairs.items()), reverse=True)
    assert [p["lift"] for p in got["pairs"]] == pytest.approx(lifts[:3])


def test_layer_transitions(planted):
    reqs, trace = planted
    got = report(trace, views=["transitions"], top=E * E)["transitions"]
    assert [(g["from_layer"], g["to_layer"]) for g in got] == list(
        zip(LAYERS[:-1], LAYERS[1:], strict=True)
    )
    n = sum(1 for _ in token_rows(reqs))
    for col, g in enumerate(got):
        sets, top1 = ref_transitions(reqs, col)
        assert {(p["a"], p["b"]): p["count"] for p in g["pairs"]} == dict(sets)
        best = Counter()
        for (a, _), c in top1.items():
            best[a] = max(best[a], c)
        assert g["top1_predictability"] == pytest.approx(sum(best.values()) / n)
        nxt = Counter()
        for (_, b), c in top1.items():
            nxt[b] += c
        assert g["top1_chance"] == pytest.approx(max(nxt.values()) / n)
    # column 2 -> 3 is planted: top-1 + 1, perfectly predictable
    assert got[2]["top1_predictability"] == 1.0
    assert all(p["b"] == (p["a"] + 1) % E for p in got[2]["top1_pairs"])


def test_vocabulary_of_an_expert_and_a_token(planted):
    reqs, trace = planted
    r = report(trace, experts=["2:7"], tokens=[str(TOKEN_PLANT)], top=5, chunk_rows=7)
    routed, seen = Counter(), Counter()
    for _, _, token, _, row in token_rows(reqs):
        seen[token] += 1
        if 7 in row[1]:
            routed[token] += 1
    e = r["vocab"]["experts"][0]
    assert (e["layer"], e["expert"]) == (2, 7)
    assert e["tokens_routed"] == sum(routed.values())
    assert e["distinct_tokens"] == len(routed)
    want = sorted(routed.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert [(t["token"], t["count"]) for t in e["top_tokens"]] == want
    assert e["top_tokens"][0]["token"] == TOKEN_PLANT
    for t in e["top_tokens"]:
        assert t["share_of_token"] == pytest.approx(routed[t["token"]] / seen[t["token"]])
    tok = r["vocab"]["tokens"][0]
    rows = [row for _, _, token, _, row in token_rows(reqs) if token == TOKEN_PLANT]
    assert tok["occurrences"] == len(rows)
    col1 = tok["layers"][1]["experts"][0]
    assert (col1["expert"], col1["share_of_token"]) == (7, 1.0)
    for col, layer in enumerate(tok["layers"]):
        c = Counter(int(e) for row in rows for e in row[col])
        assert {x["expert"]: x["count"] for x in layer["experts"]} == dict(
            sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        )


def test_request_and_token_views(planted):
    reqs, trace = planted
    r = report(trace, request_ids=["r1"], views=["summary"])
    assert r["views"] == ["summary", "requests", "tokens"]
    req = reqs[1]
    q = r["request_table"][0]
    assert (q["id"], q["prompt_len"], q["output_len"], q["rows"]) == ("r1", 40, 25, 64)
    rows = req.routed_experts
    want = np.mean([rows[t, c, 0] == rows[t - 1, c, 0] for t in range(1, 64) for c in range(4)])
    assert q["top1_repeat"] == pytest.approx(want)
    used = np.mean([len(set(rows[:, c].ravel().tolist())) for c in range(4)]) / E
    assert q["experts_touched"] == pytest.approx(used)
    tokens = r["token_table"][0]["tokens"]
    assert len(tokens) == 65
    assert tokens[3]["experts"] == rows[3].tolist() and tokens[3]["part"] == "prompt"
    assert tokens[-1]["experts"] is None  # the last sampled token never ran
    assert tokens[-1]["token"] == int(req.output_token_ids[-1])
    out = report(trace, request_ids=["r1"], part="output")["token_table"][0]["tokens"]
    assert [t["position"] for t in out] == list(range(40, 65))


def test_views_that_need_arguments(planted):
    _, trace = planted
    with pytest.raises(MoetraceError, match="--ep-size"):
        report(trace, views=["ep"])
    with pytest.raises(MoetraceError, match="unknown view"):
        report(trace, views=["nope"])
    with pytest.raises(MoetraceError, match="LAYER:EXPERT"):
        report(trace, experts=["7"])
    with pytest.raises(MoetraceError, match="not among"):
        report(trace, experts=["0:1"])


def test_rows_of_records_left_out_are_not_counted(tmp_path):
    """A killed recording's tail record whose data is not on disk stays out of every figure."""
    import h5py

    reqs = planted_requests(8, seed=2)
    path = write_trace(tmp_path / "t.h5", reqs)
    with h5py.File(path, "r+") as f:
        f.attrs["complete"] = False
        rec = f["requests"][-1]
        rec["checksum"] ^= 1
        f["requests"][-1] = rec
    with open_trace(path) as trace:
        assert trace.num_dropped == 1
        r = report(trace, views=["load", "locality"])
    assert r["expert_counts"] == ref_counts(reqs[:-1]).tolist()
    assert r["locality"][0]["pairs"] == ref_locality(reqs[:-1])[0]
