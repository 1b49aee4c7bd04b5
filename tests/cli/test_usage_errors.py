"""Option values a command cannot honour are usage errors (exit 2, one line), never taken
silently: a context past the model's was capped, a negative --limit acted as a slice,
--ep-size 0 and a token id past the vocabulary were ignored."""

from __future__ import annotations

import json

from support.cli import moetrace, trace  # noqa: F401  (the fixture: a demo trace)


def _usage_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def test_a_context_past_the_models_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi", "max_tokens": 2}) + "\n")
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "--max-model-len", "4096",
                    cwd=tmp_path)  # fmt: skip
    _usage_error(proc, "--max-model-len 4096: above the context of demo (1024 tokens")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "t.h5").exists()
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "--max-model-len", "1024", "-q",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # the model's own context is allowed


def test_inspect_and_diff_refuse_values_they_would_ignore(trace):  # noqa: F811
    _usage_error(moetrace("inspect", str(trace), "--limit", "-1"), "--limit")
    _usage_error(moetrace("inspect", str(trace), "--ep-size", "0"), "--ep-size")
    _usage_error(moetrace("diff", str(trace), str(trace), "--limit", "-2"), "--limit")
    proc = moetrace("inspect", str(trace), "--token", "99999")
    _usage_error(proc, "--token 99999: outside the vocabulary (token ids 0..259)")
    assert proc.stderr.splitlines() == [
        "error: --token 99999: outside the vocabulary (token ids 0..259)"
    ]
    assert moetrace("inspect", str(trace), "--token", "259", "--limit", "0").returncode == 0
