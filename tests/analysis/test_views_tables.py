"""Request tables as inspect prints them in a pipe: every id whole, however long, and no
header or figure cut short (served ids all begin ``cmpl-``, so a cut id hid the request)."""

from __future__ import annotations

import json

from support.cli import moetrace

IDS = [f"cmpl-3f9a1c2e4b5d6e7f8a9b0c1d2e3f4a{i}b-{i}-served-by-moetrace" for i in range(3)]


def test_request_ids_are_whole_in_the_requests_table(tmp_path):
    lines = [{"id": rid, "prompt": "Hello experts", "max_tokens": 3} for rid in [*IDS, "short"]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = moetrace("inspect", "t.h5", "--view", "requests", cwd=tmp_path).stdout
    body = out.split("━")[-1].splitlines()
    column = "".join(line.split()[0] for line in body if line.strip())  # the id column's text
    for rid in [*IDS, "short"]:
        assert rid in column, (rid, out)
    assert "…" not in out
    for header in ("prompt", "output", "finish", "cached", "preempt", "top-1", "experts"):
        assert header in out, header
