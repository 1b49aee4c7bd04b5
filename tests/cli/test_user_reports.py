"""What the reports say when there is little or nothing to say, as the console script says it:
an empty selection, a partial merge, the JSON attributes of a trace."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
from support.cli import moetrace

from moetrace import open_trace

PROMPTS = [{"id": f"q{i}", "prompt": "Hello experts " * (i + 1)} for i in range(6)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("reports")
    lines = [json.dumps(p) for p in PROMPTS] + ['{"id": "bad", "prompt": 7}']
    (tmp / "p.jsonl").write_text("\n".join(lines) + "\n")
    args = ("-q", "--max-tokens", "4", "--skip-invalid")
    for i in range(3):
        proc = moetrace("record", "demo", "p.jsonl", "-o", f"s{i}.h5", "--num-shards", "3",
                        "--shard-index", str(i), *args, cwd=tmp)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    return tmp


def test_an_empty_selection_reports_nulls_not_zeros(recorded):
    proc = moetrace("inspect", "s0.h5", "--range", "5:2", "--ep-size", "2", "--json", cwd=recorded)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["selection"]["rows"] == 0
    for layer in report["layer_load"]:
        assert layer["dead_experts"] is None and layer["top_expert"] is None
        assert layer["min"] is None and layer["max"] is None
    assert all(share is None for share in report["expert_shares"])
    assert all(p["busiest_rank"] is None for p in report["ep"]["layers"])
    text = moetrace("inspect", "s0.h5", "--range", "5:2", cwd=recorded).stdout
    assert "nothing selected" in text
    load_rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["1"]]
    assert load_rows[0] == ["1", "-", "-", "-", "-", "-", "-", "-", "-"]  # min ... dead


def test_a_merge_of_some_shards_stays_incomplete(recorded):
    proc = moetrace("merge", "two.h5", "s0.h5", "s1.h5", cwd=recorded)
    assert proc.returncode == 0, proc.stderr
    assert "marked incomplete: shard(s) 2 of 3 not given" in proc.stderr
    verified = moetrace("verify", "two.h5", cwd=recorded)
    assert verified.returncode == 3  # incomplete
    assert (
        "merge again with every shard, or with --as-complete" in verified.stdout + verified.stderr
    )
    proc = moetrace("merge", "all.h5", "s0.h5", "s1.h5", "s2.h5", cwd=recorded)
    assert proc.returncode == 0 and "complete" in proc.stderr
    assert moetrace("verify", "all.h5", cwd=recorded).returncode == 0
    proc = moetrace("merge", "asked.h5", "s0.h5", "s1.h5", "--as-complete", cwd=recorded)
    assert proc.returncode == 0 and moetrace("verify", "asked.h5", cwd=recorded).returncode == 0


def test_json_attributes_read_as_what_they_hold(recorded):
    proc = moetrace("record", "demo", "p.jsonl", "-o", "s0.h5", "--num-shards", "3",
                    "--shard-index", "0", "-q", "--max-tokens", "4", "--skip-invalid", "--resume",
                    cwd=recorded)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with open_trace(recorded / "s0.h5") as trace:
        md = trace.metadata
    assert isinstance(md["resumes"], list) and md["resumes"][0]["kept_requests"] == 2
    assert [s["line"] for s in md["skipped_inputs"]] == [7]
    assert isinstance(md["engine_settings"], dict) and md["merged_from"] == []


@pytest.mark.parametrize("content", ["", "\n", '{"prompt": 7}\n'])
def test_an_empty_or_all_bad_input_leaves_no_file_from_stdin_as_from_a_file(tmp_path, content):
    (tmp_path / "p.jsonl").write_text(content)
    said = []
    for source in ("p.jsonl", "-"):
        out = tmp_path / f"t{len(said)}.h5"
        proc = moetrace("record", "demo", source, "-o", str(out), "-q", "--skip-invalid",
                        cwd=tmp_path, input=content)  # fmt: skip
        assert proc.returncode == 1 and not out.exists(), proc.stderr
        said.append(proc.stderr.strip().splitlines()[-1].replace("<stdin>", "p.jsonl"))
    assert said[0] == said[1]


@pytest.mark.parametrize("part", ["prompt", "output"])
def test_the_request_view_honours_part(recorded, part):
    proc = moetrace("inspect", "s0.h5", "-v", "requests", "--part", part, "--json", cwd=recorded)
    assert proc.returncode == 0, proc.stderr
    got = {q["id"]: q for q in json.loads(proc.stdout)["request_table"]}
    with h5py.File(recorded / "s0.h5", "r") as f:  # the expected figures from the file alone
        for rec in f["requests"][:]:
            r0, n, p = int(rec["row_start"]), int(rec["num_rows"]), int(rec["prompt_len"])
            rows = f["routed_experts"][r0 : r0 + n]
            rows = rows[:p] if part == "prompt" else rows[p:]
            q = got[rec["id"].decode()]
            assert q["part"] == part and q["rows"] == len(rows)
            repeat = (rows[1:, :, 0] == rows[:-1, :, 0]).mean()
            assert q["top1_repeat"] == pytest.approx(float(repeat))
