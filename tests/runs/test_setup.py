"""The model, tokenizer and revision a run is given, named as the user gave them when wrong."""

from __future__ import annotations

import json

import pytest
from support.cli import moetrace


@pytest.fixture
def prompts(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi", "max_tokens": 2}) + "\n")
    return tmp_path


def _error(proc) -> str:
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    return line


def test_a_tokenizer_that_is_not_there_is_named_as_the_option(prompts):
    line = _error(moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "--tokenizer", "nope",
                           cwd=prompts))  # fmt: skip
    assert line.startswith("error: --tokenizer nope: no such directory")
    assert "model 'nope'" not in line
    assert not (prompts / "t.h5").exists()


def test_a_revision_of_the_demo_or_a_directory_says_what_it_is(prompts):
    line = _error(moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "--revision", "main",
                           cwd=prompts))  # fmt: skip
    assert line.startswith("error: --revision main: 'demo' is the built-in model, not a model id")
    line = _error(moetrace("record", str(prompts), "p.jsonl", "-o", "t.h5", "--revision", "v1",
                           cwd=prompts))  # fmt: skip
    assert line.startswith(f"error: --revision v1: {str(prompts)!r} is a directory")
