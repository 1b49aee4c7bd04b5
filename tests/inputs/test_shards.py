"""Data-parallel shards: K runs record disjoint thirds; merged, they are the single run.

Each shard keeps the requests' input indices, so a request without its own
seed samples the same tokens in its shard as in one run; merge then gives,
request by request, the single run's tokens and routing rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.dist import CONFIGS, write_checkpoint
from typer.testing import CliRunner

from moetrace import open_trace
from moetrace.analysis.merge import merge_traces
from moetrace.cli.app import app
from moetrace.config import EngineConfig
from moetrace.errors import MoetraceError
from moetrace.inputs.prompts import iter_prompts
from moetrace.inputs.shards import ShardedPrompts, check_shard_set, in_shard
from moetrace.runs.recording import Recording, SamplingDefaults
from moetrace.runs.setup import RunOptions

NUM_SHARDS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    ckpt = write_checkpoint(CONFIGS["qwen3"](), tmp / "ckpt")
    rng = np.random.default_rng(11)
    lines = []
    for i in range(10):
        line = {"prompt_token_ids": rng.integers(0, 97, int(rng.integers(2, 12))).tolist()}
        if i % 4 == 1:
            line["id"] = f"named-{i}"  # explicit ids and default (index) ids mixed
        lines.append(json.dumps(line))
    lines.insert(3, "")  # a blank line takes no index
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    return tmp, ckpt, prompts


def record(ckpt, prompts, out, **shard) -> None:
    Recording(
        RunOptions.of(
            str(ckpt),
            engine=EngineConfig(num_kv_blocks=64, block_size=4),
            device="cpu",
            dtype="float64",
        ),
        str(prompts),
        out,
        # Sampled without per-line seeds: each request's seed comes from its input index.,
        sampling=SamplingDefaults(max_tokens=5, temperature=0.8, top_p=0.9),
        **shard,
    ).run()


def by_id(path) -> dict:
    with open_trace(path) as t:
        return {r.id: r for r in t}


@pytest.fixture(scope="module")
def runs(setup):
    tmp, ckpt, prompts = setup
    record(ckpt, prompts, tmp / "single.h5")
    shards = []
    for i in range(NUM_SHARDS):
        out = tmp / f"shard{i}.h5"
        record(ckpt, prompts, out, num_shards=NUM_SHARDS, shard_index=i)
        shards.append(out)
    return tmp / "single.h5", shards


def test_shards_partition_the_prompts_by_input_index(runs):
    single, shards = runs
    everything = by_id(single)
    seen: set[str] = set()
    for i, path in enumerate(shards):
        held = by_id(path)
        assert held and all(in_shard(r.index, NUM_SHARDS, i) for r in held.values())
        assert not seen & set(held)
        seen |= set(held)
        with open_trace(path) as t:
            assert t.complete and t.verify() == []
            settings = t.metadata["engine_settings"]
            assert (settings["num_shards"], settings["shard_index"]) == (NUM_SHARDS, i)
            assert int(t.metadata["expected_requests"]) == len(held)
    assert seen == set(everything)


def test_merged_shards_equal_the_single_run(runs, tmp_path):
    single, shards = runs
    merged = tmp_path / "merged.h5"
    result = CliRunner().invoke(app, ["merge", str(merged), *map(str, reversed(shards))])
    assert result.exit_code == 0, result.output
    want, got = by_id(single), by_id(merged)
    assert set(got) == set(want)
    for rid, r in want.items():
        g = got[rid]
        assert g.index == r.index
        np.testing.assert_array_equal(g.prompt_token_ids, r.prompt_token_ids)
        np.testing.assert_array_equal(g.output_token_ids, r.output_token_ids, err_msg=rid)
        np.testing.assert_array_equal(g.routed_experts, r.routed_experts, err_msg=rid)
    with open_trace(merged) as t:
        assert t.complete and t.verify() == []


def test_merge_notes_a_missing_shard_and_refuses_a_repeated_one(runs, tmp_path):
    _, shards = runs
    result = merge_traces(tmp_path / "partial.h5", shards[:2])
    assert result["partial"] == ["shard(s) 2 of 3 not given"] and not result["complete"]
    with open_trace(tmp_path / "partial.h5") as t:  # verify calls it incomplete, not damaged
        assert not t.complete and t.verify() == []
        assert t.metadata["end_reason"] == "partial merge: shard(s) 2 of 3 not given"
    asked = merge_traces(tmp_path / "asked.h5", shards[:2], as_complete=True)
    assert asked["complete"]
    with open_trace(tmp_path / "asked.h5") as t:
        assert t.complete
    with pytest.raises(MoetraceError):  # the same shard twice: same request ids, same shard
        merge_traces(tmp_path / "twice.h5", [shards[0], shards[0]])
    with pytest.raises(MoetraceError, match="both shard 1"):
        check_shard_set([{"num_shards": 3, "shard_index": 1}] * 2, ["a.h5", "b.h5"])
    with pytest.raises(MoetraceError, match="different --num-shards"):
        check_shard_set(
            [{"num_shards": 3, "shard_index": 1}, {"num_shards": 2, "shard_index": 0}],
            ["a.h5", "b.h5"],
        )


def test_a_shard_may_select_nothing(setup, tmp_path):
    _, ckpt, _ = setup
    prompts = tmp_path / "two.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3, 4]}\n')
    out = tmp_path / "empty.h5"
    record(ckpt, prompts, out, num_shards=4, shard_index=3)
    with open_trace(out) as t:
        assert t.complete and t.num_requests == 0


def test_selection_is_by_input_index(setup):
    _, _, prompts = setup
    every = [s.index for s in iter_prompts(str(prompts))]
    assert every == list(range(10))
    for i in range(NUM_SHARDS):
        got = [s.index for s in ShardedPrompts(iter_prompts(str(prompts)), NUM_SHARDS, i)]
        assert got == every[i::NUM_SHARDS]


def test_shard_options_on_the_command_line(setup, tmp_path):
    _, ckpt, prompts = setup
    out = tmp_path / "s.h5"
    args = ["record", str(ckpt), str(prompts), "-o", str(out), "--device", "cpu", "-q"]
    result = CliRunner().invoke(app, [*args, "--num-shards", "2", "--shard-index", "2"])
    assert isinstance(result.exception, MoetraceError)
    assert "--shard-index must be in 0..1" in str(result.exception)
    assert not out.exists()
    result = CliRunner().invoke(app, [*args, "--num-shards", "2", "--shard-index", "1"])
    assert result.exit_code == 0, result.output
    assert sorted(r.index for r in by_id(out).values()) == [1, 3, 5, 7, 9]
