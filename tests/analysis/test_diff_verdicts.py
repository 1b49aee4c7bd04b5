"""``moetrace diff`` as a user meets it: two verdicts, and diff(1)'s exit codes.

Each pair of traces is recorded by the installed console script from the same
prompts, changing one thing; what the verdicts must say follows from that
change alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.cli import moetrace

PROMPTS = [
    {"id": "greeting", "prompt": "Hello! Tell me about experts."},
    {"id": "code", "prompt": "def fibonacci(n):"},
    {"id": "ids", "prompt_token_ids": [72, 101, 108, 108, 111]},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("diff")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    variants = {
        "base": ["--max-tokens", "16"],
        "again": ["--max-tokens", "16", "--max-num-seqs", "1"],  # other batching, same run
        "short": ["--max-tokens", "6"],
        "seed1": ["--max-tokens", "16", "--temperature", "1", "--seed", "1"],
        "seed2": ["--max-tokens", "16", "--temperature", "1", "--seed", "2"],
        "bf16": ["--max-tokens", "16", "--dtype", "bfloat16"],
    }
    out = {}
    for name, args in variants.items():
        out[name] = tmp / f"{name}.h5"
        proc = moetrace("record", "demo", str(prompts), "-o", str(out[name]), "-q", *args)
        assert proc.returncode == 0, proc.stderr
    return out


def diff(a: Path, b: Path, *args: str):
    proc = moetrace("diff", str(a), str(b), "--json", *args)
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout else None), proc.stderr


def test_identical_runs_exit_0(runs):
    code, d, _ = diff(runs["base"], runs["again"])
    assert code == 0 and d["identical"]
    assert d["verdict"] == {"routing": "identical", "sequences": "identical"}


def test_a_shorter_run_has_identical_routing_and_other_sequences(runs):
    code, d, _ = diff(runs["base"], runs["short"])
    assert code == 1 and not d["identical"]
    assert d["verdict"] == {"routing": "identical", "sequences": "differ"}
    assert d["requests"]["one_is_shorter"] == 3 and d["requests"]["tokens_diverged"] == 0
    assert d["tokens_with_difference"] == 0 and d["rows_excluded"] == 3 * 10


def test_two_seeds_route_alike_until_their_tokens_part(runs):
    code, d, _ = diff(runs["seed1"], runs["seed2"])
    assert code == 1
    assert d["verdict"] == {"routing": "identical", "sequences": "differ"}
    assert d["requests"]["tokens_diverged"] >= 1
    proc = moetrace("diff", str(runs["seed1"]), str(runs["seed2"]))
    assert proc.returncode == 1
    routing = next(line for line in proc.stdout.splitlines() if line.strip().startswith("routing"))
    assert "identical at all" in routing


def test_other_routing_exits_1_and_says_so(runs):
    code, d, _ = diff(runs["base"], runs["bf16"])
    if d["verdict"]["routing"] == "identical":  # bf16 may route this demo alike: then tokens too
        assert code == (0 if d["identical"] else 1)
    else:
        assert code == 1 and d["verdict"]["routing"] == "differs"


def test_no_request_pairs_up_warns_and_exits_2(runs, tmp_path):
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text(
        "".join(json.dumps({**p, "id": f"chatcmpl-{i}"}) + "\n" for i, p in enumerate(PROMPTS))
    )
    other = tmp_path / "renamed.h5"
    proc = moetrace("record", "demo", str(renamed), "-o", str(other), "-q", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    code, d, _ = diff(runs["base"], other)
    assert code == 2 and d["requests"]["compared"] == 0
    assert any("try --match index" in w for w in d["warnings"])
    code, d, _ = diff(runs["base"], other, "--match", "index")
    assert code == 0 and d["identical"]


def test_trouble_exits_2(runs, tmp_path):
    code, _, err = diff(runs["base"], tmp_path / "missing.h5")
    assert code == 2 and err.startswith("error: no such trace file")
    code, _, err = diff(runs["base"], runs["again"], "-r", "nope")
    assert code == 2 and "no request 'nope'" in err


@pytest.mark.parametrize("as_json", [False, True])
def test_the_verdict_survives_a_reader_that_leaves_early(runs, as_json):
    """``moetrace diff a b | head -1`` under pipefail: different runs still exit 1."""
    read, write = os.pipe()
    os.close(read)  # every write meets a closed pipe, whatever the timing
    try:
        args = ["--json"] if as_json else []
        different = moetrace("diff", str(runs["base"]), str(runs["short"]), *args, stdout=write)
        same = moetrace("diff", str(runs["base"]), str(runs["again"]), *args, stdout=write)
    finally:
        os.close(write)
    assert (different.returncode, different.stderr) == (1, "")
    assert (same.returncode, same.stderr) == (0, "")
