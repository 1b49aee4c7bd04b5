"""The Python API as docs/python-api.md shows it (its examples run here), and its edges."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
from support.reliability import run_cli, write_jsonl

from moetrace import open_trace

DOCS = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
# The four prompts `make demo` records (Makefile).
DEMO_PROMPTS = [
    {"id": "greeting", "prompt": "Hello! Tell me about experts."},
    {"id": "code", "prompt": "def fibonacci(n):", "max_tokens": 24},
    {"id": "chat", "messages": [{"role": "user", "content": "What is routing?"}]},
    {"id": "ids", "prompt_token_ids": [72, 101, 108, 108, 111]},
]


def test_the_python_api_page_runs_as_written(tmp_path, monkeypatch):
    prompts = write_jsonl(tmp_path / "demo-prompts.jsonl", DEMO_PROMPTS)
    code, _, err = run_cli("record", "demo", str(prompts), "-o", str(tmp_path / "demo-trace.h5"))
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    result = doctest.testfile(
        str(DOCS), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0 and result.attempted >= 25


def test_samples_keys_orders_and_refusals(tmp_path):
    lines = [
        {"id": "b", "prompt": "second", "n": 2, "temperature": 1.0},
        {"id": "a", "prompt": "first input line? no: third", "max_tokens": 2},
    ]
    lines.insert(0, {"id": "z", "prompt": "the first line", "max_tokens": 30})
    prompts = write_jsonl(tmp_path / "p.jsonl", lines)
    code, _, err = run_cli("record", "demo", str(prompts), "-o", str(tmp_path / "t.h5"), "-q",
                           "--max-tokens", "5")  # fmt: skip
    assert code == 0, err
    with open_trace(tmp_path / "t.h5") as trace:
        assert [(r.id, r.sample_index) for r in trace.in_input_order()] == [
            ("z", 0), ("b", 0), ("b", 1), ("a", 0)
        ]  # fmt: skip
        assert [r.id for r in trace][-1] == "z"  # file order: it finished last
        assert trace["b", 1].sample_index == 1 and trace["b"].sample_index == 0
        assert ("b", 1) in trace and ("b", 2) not in trace and "x" not in trace
        with pytest.raises(KeyError, match="no request with id 'b' sample 2"):
            trace["b", 2]
        with pytest.raises(IndexError, match="out of range"):
            trace[4]
        with pytest.raises(TypeError):
            trace[1.5]
        df = trace.to_pandas()
        assert df.set_index(["id", "sample_index"]).loc[("b", 1), "index"] == 1
        assert json.loads(df.to_json())["finish_reason"]["0"] in ("stop", "length")
