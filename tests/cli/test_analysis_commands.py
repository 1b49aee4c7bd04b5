"""The analysis commands as a user meets them, on a real demo recording and in shell pipelines."""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.cli import moetrace
from typer.testing import CliRunner

from moetrace import open_trace
from moetrace.analysis.diff import diff_traces
from moetrace.cli.app import app
from moetrace.errors import MoetraceError

MOETRACE = f"{shlex.quote(sys.executable)} -m moetrace"
PROMPTS = [
    {"id": "fox", "prompt": "The quick brown fox jumps over the lazy dog."},
    {"id": "code", "prompt": "def add(a, b):\n    return a + b\n", "max_tokens": 8},
    {"id": "q3", "prompt_token_ids": list(range(40, 70)), "max_tokens": 4},
]


def sh(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """Recorded exactly as the README says: cat prompts.jsonl | moetrace record demo - -o t.h5"""
    tmp = tmp_path_factory.mktemp("demo")
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    proc = sh(f"cat prompts.jsonl | {MOETRACE} record demo - -o t.h5 -q --max-tokens 6", tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp / "t.h5"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_stdin_pipeline_recorded_every_prompt(demo):
    with open_trace(demo) as t:
        assert sorted(t.request_ids) == ["code", "fox", "q3"]
        assert t.complete and t.verify() == []
        assert t.request("q3").prompt_token_ids.tolist() == list(range(40, 70))


def test_export_pipeline_decodes_with_plain_numpy(demo):
    decode = (
        "import base64, io, json, sys, numpy as np; "
        "[print(json.dumps({'id': o['id'], 'rows': np.load(io.BytesIO(base64.b64decode("
        "o['routed_experts']))).tolist()})) for o in map(json.loads, sys.stdin)]"
    )
    proc = sh(
        f"{MOETRACE} export t.h5 | {shlex.quote(sys.executable)} -c {shlex.quote(decode)}",
        demo.parent,
    )
    assert proc.returncode == 0, proc.stderr
    got = {o["id"]: o["rows"] for o in map(json.loads, proc.stdout.splitlines())}
    with h5py.File(demo) as f:
        for rec in f["requests"][:]:
            rid = rec["id"].decode()
            r0, n = int(rec["row_start"]), int(rec["num_rows"])
            assert got[rid] == f["routed_experts"][r0 : r0 + n].tolist()


def test_inspect_json_views_agree_with_h5py(demo):
    res = invoke("inspect", demo, "--all", "--ep-size", "2", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["views"] == [
        "summary", "load", "ep", "locality", "coactivation", "transitions", "requests",
    ]  # fmt: skip
    with h5py.File(demo) as f:
        rows = f["routed_experts"][:]
        num_experts, k = int(f.attrs["num_experts"]), int(f.attrs["top_k"])
    for i, layer in enumerate(r["layer_load"]):
        counts = np.bincount(rows[:, i].ravel(), minlength=num_experts)
        assert r["expert_counts"][i] == counts.tolist()
        assert layer["max_violation"] == pytest.approx(counts.max() / counts.mean() - 1)
        half = num_experts // 2
        assert r["ep"]["layers"][i]["rank_load"] == [counts[:half].sum(), counts[half:].sum()]
    assert len(r["transitions"]) == len(r["layer_load"]) - 1
    assert len(r["request_table"]) == 3
    assert r["selection"]["rows"] == rows.shape[0]
    assert all(len(p["pairs"]) <= 5 for p in r["coactivation"])
    assert r["ep"]["top_k"] == k


def test_inspect_tables_and_token_text(demo):
    res = invoke("inspect", demo, "--request", "fox", "--layer", "2")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "max/mean" in out and "MaxVio" in out and "Gini" in out
    assert "request 'fox'" in out and "L2" in out
    assert re.search(r"\b4\s+prompt\s+113\s+q\s", out)  # token 4 of "The quick", decoded
    res = invoke("inspect", demo, "--token-text", "o", "--part", "prompt")
    assert res.exit_code == 0, res.output
    assert "token 111 'o'" in res.stdout


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_plots_are_written(demo, tmp_path, suffix):
    out = tmp_path / f"load{suffix}"
    res = invoke("inspect", demo, "--ep-size", "4", "--plot", out, "--json")
    assert res.exit_code == 0, res.output
    data = out.read_bytes()
    assert len(data) > 5_000
    if suffix == ".png":
        assert data.startswith(b"\x89PNG")
    elif suffix == ".html":
        text = data.decode()
        assert text.startswith("<!DOCTYPE html>") and "<svg" in text and "</html>" in text
    else:
        assert b"<svg" in data


def test_a_plot_replaces_a_file_only_with_overwrite_as_every_output(demo, tmp_path):
    """--plot wrote over an existing file without a word; every other output refuses."""
    out = tmp_path / "load.png"
    out.write_bytes(b"keep me")
    for command in (["inspect", str(demo)], ["diff", str(demo), str(demo)]):
        proc = moetrace(*command, "--plot", str(out))
        assert proc.returncode in (1, 2) and out.read_bytes() == b"keep me", proc.stderr
        assert proc.stderr.splitlines() == [
            f"error: {out} already exists (pass --overwrite to replace it)"
        ]
        proc = moetrace(*command, "--plot", str(out), "--overwrite")
        assert proc.returncode == 0, proc.stderr
        assert out.read_bytes().startswith(b"\x89PNG")
        out.write_bytes(b"keep me")


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    from moetrace.analysis import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MoetraceError, match=r"make extra EXTRA=plot"):
        plots.check_plot_path(tmp_path / "x.png", overwrite=False, inputs=[])
    with pytest.raises(MoetraceError, match="must end in"):
        plots.check_plot_path(tmp_path / "x.jpg", overwrite=False, inputs=[])


def test_vllm_import_diffs_against_the_moetrace_trace(demo, tmp_path):
    """A vLLM response of the same requests (dense layer 0 left at zero, int32 .npy) agrees;
    one changed expert shows up as exactly one mismatching token."""
    lines = []
    with open_trace(demo) as t:
        num_hidden = int(t.metadata["num_hidden_layers"])
        moe = t.metadata["moe_layer_indices"]
        for req in t:
            full = np.zeros((req.num_rows, num_hidden, t.top_k), dtype=np.int32)
            full[:, moe] = req.routed_experts
            if req.id == "code":
                full[3, moe[1], 0] = next(
                    e for e in range(t.num_experts) if e not in full[3, moe[1]]
                )
            buf = io.BytesIO()
            np.save(buf, full)
            body = {
                "id": "chatcmpl-1",
                "prompt_token_ids": req.prompt_token_ids.tolist(),
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": req.finish_reason,
                        "token_ids": req.output_token_ids.tolist(),
                        "routed_experts": base64.b64encode(buf.getvalue()).decode(),
                    }
                ],
            }
            lines.append(json.dumps({"custom_id": req.id, "response": {"body": body}}))
    src = tmp_path / "vllm.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "vllm.h5"
    res = invoke("import", src, "--model", "demo", "-o", out)
    assert res.exit_code == 0, res.output
    with open_trace(out) as v, open_trace(demo) as m:
        assert v.metadata["config_digest"] == m.metadata["config_digest"]
        d = diff_traces(v, m)
    assert d["warnings"] == []
    assert d["tokens_with_difference"] == 1 and d["router_mismatch"] > 0
    assert [x["id"] for x in d["request_detail"]] == ["code"]
    assert d["request_detail"][0]["first_differing_token"] == 3
    assert [x["set_differs"] for x in d["layers"]] == [0, 1, 0]


def test_errors_are_one_line(demo, monkeypatch, capsys):
    from moetrace.cli.app import main

    monkeypatch.setattr(sys, "argv", ["moetrace", "inspect", str(demo), "--layer", "0"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: layer 0 does not route; the MoE layers are 1, 2, 3"
    ]
