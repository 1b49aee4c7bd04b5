"""A chat template is foreign code: the sandbox holds, and now its time and output are bounded.

Two nested ``range(100000)`` loops hung ``record`` for hours, and 5,000 nested
parentheses printed a 3,000-line RecursionError.  Each case goes through the
real CLI on a copy of the demo checkpoint whose template was swapped.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
from support.reliability import assert_one_line_error, run_cli, write_jsonl

import moetrace.inputs.tokenizer as tokenizer_module
from moetrace.models.demo import DEMO_DIR

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CALL_FREE_LOOPS = (  # no call, attribute or output inside: only the line budget sees them
    "{% set s = 'ab' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
)

CASES = {
    "nested range loops": (LOOPS, "ran for more than 0.5 s"),
    "loops that call nothing": (CALL_FREE_LOOPS, "ran for more than 0.5 s"),
    "unbounded output": (
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "output passed 16,777,216 characters",
    ),
    "one huge repetition": ("{{ 'x' * 10000000000 }}", "a repetition of 10,000,000,000"),
    "a huge power": ("{{ 7 ** 100000000 }}", "7 ** 100000000 is too large"),
    "5,000 nested parentheses": (
        "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
        "nested too deeply to compile",
    ),
    "endless recursion": (
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
        "recursed too deeply",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_costly_chat_template_is_one_line(tmp_path, monkeypatch, name):
    template, needle = CASES[name]
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.5)
    ckpt = tmp_path / "demo-copy"
    shutil.copytree(DEMO_DIR, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "t.h5"
    start = time.monotonic()
    code, _, err = run_cli("record", str(ckpt), str(prompts), "-o", str(out), "-q")
    assert_one_line_error(code, err, "p.jsonl:1", "'messages'", needle)
    assert time.monotonic() - start < 30 and not out.exists()
