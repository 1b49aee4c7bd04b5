"""merge: shards of one recording become one trace; shards that are not are refused."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from support.analysis import metadata, planted_requests, write_trace
from typer.testing import CliRunner

from moetrace import open_trace
from moetrace.analysis.merge import merge_traces
from moetrace.cli.app import app
from moetrace.errors import MoetraceError


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge")
    reqs = planted_requests()
    paths = [
        write_trace(tmp / "s0.h5", reqs[0::3], metadata(engine_settings={"shard": 0})),
        write_trace(tmp / "s1.h5", reqs[1::3], metadata(engine_settings={"shard": 1})),
        write_trace(tmp / "s2.h5", reqs[2::3], metadata(engine_settings={"shard": 2})),
    ]
    return reqs, paths


def test_merge_keeps_every_request_and_checks_out(shards, tmp_path):
    reqs, paths = shards
    out = tmp_path / "all.h5"
    res = CliRunner().invoke(app, ["merge", str(out), *map(str, paths)])
    assert res.exit_code == 0, res.output
    order = reqs[0::3] + reqs[1::3] + reqs[2::3]
    with open_trace(out) as t:
        assert t.complete and t.verify() == []
        assert t.request_ids == [r.request_id for r in order]
        for got, want in zip(t, order, strict=True):
            np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
            np.testing.assert_array_equal(got.prompt_token_ids, want.prompt_token_ids)
            np.testing.assert_array_equal(got.output_token_ids, want.output_token_ids)
            assert (got.index, got.finish_reason) == (want.index, want.finish_reason)
            assert (got.num_cached_tokens, got.num_preemptions) == (
                want.num_cached_tokens,
                want.num_preemptions,
            )
        assert t.metadata["moe_layer_indices"] == [1, 2, 3, 5]
    with h5py.File(out) as f:
        provenance = json.loads(f.attrs["merged_from"])
    assert [p["requests"] for p in provenance] == [len(reqs[i::3]) for i in range(3)]
    assert [p["engine_settings"]["shard"] for p in provenance] == [0, 1, 2]


def test_merge_refuses_foreign_shards(shards, tmp_path):
    reqs, paths = shards
    other = write_trace(tmp_path / "o.h5", reqs[:2], metadata(config_digest="ee" * 32))
    with pytest.raises(MoetraceError, match="config_digest"):
        merge_traces(tmp_path / "x.h5", [paths[0], other])
    wide = write_trace(tmp_path / "w.h5", planted_requests(6), metadata(num_experts=32))
    with pytest.raises(MoetraceError, match="num_experts"):
        merge_traces(tmp_path / "x.h5", [paths[0], wide])
    half = write_trace(tmp_path / "h.h5", reqs[:2], metadata(dtype="bfloat16"))
    with pytest.raises(MoetraceError, match="dtype"):
        merge_traces(tmp_path / "x.h5", [paths[1], half])
    with pytest.raises(MoetraceError, match="in both"):
        merge_traces(tmp_path / "x.h5", [paths[0], paths[0]])
    not_trace = tmp_path / "n.h5"
    with h5py.File(not_trace, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(MoetraceError, match="not a moetrace trace"):
        merge_traces(tmp_path / "x.h5", [paths[0], not_trace])
    assert not (tmp_path / "x.h5").exists()


def test_merge_refuses_incomplete_unless_asked(shards, tmp_path):
    reqs, paths = shards
    cut = tmp_path / "cut.h5"
    write_trace(cut, planted_requests(8, seed=5))
    with h5py.File(cut, "r+") as f:
        f.attrs["complete"] = False
    with pytest.raises(MoetraceError, match="incomplete"):
        merge_traces(tmp_path / "x.h5", [cut])
    result = merge_traces(tmp_path / "x.h5", [cut], allow_incomplete=True)
    assert result["requests"] == 8


def test_a_damaged_shard_leaves_the_file_overwrite_was_to_replace(shards, tmp_path):
    reqs, paths = shards
    damaged = tmp_path / "d.h5"
    damaged.write_bytes(paths[1].read_bytes())
    with h5py.File(damaged, "r+") as f:  # one expert id of the last row changed
        rows = f["routed_experts"]
        last = rows[-1]
        last[0, 0] = (int(last[0, 0]) + 1) % 16
        rows[-1] = last
    old = tmp_path / "all.h5"
    old.write_bytes(paths[2].read_bytes())
    with pytest.raises(MoetraceError, match="damaged"):
        merge_traces(old, [paths[0], damaged], overwrite=True)
    assert old.read_bytes() == paths[2].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.h5", "d.h5"]
    merge_traces(old, [paths[0], paths[1]], overwrite=True)
    with open_trace(old) as t:
        assert t.request_ids == [r.request_id for r in reqs[0::3] + reqs[1::3]]
    with h5py.File(old, "r") as f:
        assert [p["path"] for p in json.loads(f.attrs["merged_from"])] == list(map(str, paths[:2]))
