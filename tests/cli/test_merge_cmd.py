"""``moetrace merge`` as a user runs it: what is not shards of one run is refused by name, and
``--mixed-settings`` keeps each request's own settings instead of one run's.

Each source's settings are read back with plain h5py, not through merge.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest
from support.cli import moetrace
from support.legacy_traces import DATA


def _record(tmp: Path, name: str, prompts: list[str], *options: str) -> Path:
    lines = "".join(
        json.dumps({"id": f"{name}{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)
    )
    (tmp / f"{name}.jsonl").write_text(lines)
    proc = moetrace("record", "demo", f"{name}.jsonl", "-o", f"{name}.h5", "-q", *options, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp / f"{name}.h5"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("merge_cmd")
    return {
        "greedy": _record(tmp, "g", ["Hello experts", "def f(x):"], "--max-tokens", "6"),
        "warm": _record(
            tmp,
            "w",
            ["Routing", "What is it?"],
            "--max-tokens",
            "6",
            "--temperature",
            "0.7",
            "--seed",
            "4",
        ),  # fmt: skip
        "logprobs": _record(tmp, "l", ["Tokens"], "--max-tokens", "6", "--logprobs"),
    }


def _settings(path: Path) -> dict[str, dict]:
    """Each request's stored sampling settings, by id, and the file's engine settings."""
    with h5py.File(path, "r") as f:
        table = f["requests"][:]
        per_request = {r["id"].decode(): json.loads(r["sampling_params"]) for r in table}
        return {"requests": per_request, "run": json.loads(f.attrs["engine_settings"])}


def test_recordings_of_other_runs_are_refused_naming_the_setting(runs, tmp_path):
    out = tmp_path / "m.h5"
    proc = moetrace("merge", str(out), str(runs["greedy"]), str(runs["warm"]))
    assert proc.returncode == 1 and not out.exists()
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {runs['warm']} is not a shard of the same recording")
    assert "--seed 4" in line or "--temperature 0.7" in line
    assert "--mixed-settings" in line


def test_mixed_settings_keeps_each_requests_own_settings(runs, tmp_path):
    out = tmp_path / "m.h5"
    proc = moetrace("merge", str(out), str(runs["greedy"]), str(runs["warm"]), "--mixed-settings")
    assert proc.returncode == 0, proc.stderr
    merged = _settings(out)
    sources = {**_settings(runs["greedy"])["requests"], **_settings(runs["warm"])["requests"]}
    assert merged["requests"] == sources
    assert {s["temperature"] for s in merged["requests"].values()} == {0.0, 0.7}
    # The file claims neither run's sampling defaults nor seed.
    assert "sampling_defaults" not in merged["run"] and "seed" not in merged["run"]
    assert merged["run"]["mixed_settings"] is True
    assert moetrace("verify", str(out)).returncode == 0


def test_a_trace_with_logprobs_and_one_without_name_the_field(runs, tmp_path):
    proc = moetrace("merge", str(tmp_path / "m.h5"), str(runs["greedy"]), str(runs["logprobs"]))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: {runs['logprobs']} is not a shard of the same recording as {runs['greedy']}: "
        f"{runs['logprobs']} holds logprobs and {runs['greedy']} does not (recorded without "
        "--logprobs)"
    ]


def test_mixed_settings_refuses_a_trace_whose_requests_carry_no_settings(tmp_path):
    for name in ("a.h5", "b.h5"):
        shutil.copy(DATA / "trace_v1_uint8.h5", tmp_path / name)
    proc = moetrace("merge", "m.h5", "a.h5", "b.h5", "--mixed-settings", cwd=tmp_path)
    assert proc.returncode == 1 and not (tmp_path / "m.h5").exists()
    assert "written before requests kept their own sampling settings" in proc.stderr
