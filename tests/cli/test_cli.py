"""The command line as a user meets it: real processes, real files, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.engine import tiny_qwen3_config


def moetrace(
    *args: str, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetrace", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("demo")
    prompts = write_jsonl(
        tmp / "p.jsonl",
        [
            {"prompt": "Hello, experts!"},
            {"id": "fox", "prompt": "The quick brown fox", "max_tokens": 5},
            {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
            {"prompt_token_ids": list(range(40, 70)), "max_tokens": 3},
        ],
    )
    out = tmp / "t.h5"
    proc = moetrace("record", "demo", str(prompts), "-o", str(out), "--max-tokens", "7")
    assert proc.returncode == 0, proc.stderr
    return out


def test_record_writes_a_plain_hdf5_trace(demo_trace):
    with h5py.File(demo_trace, "r") as f:
        assert f.attrs["format"] == "moetrace-trace"
        assert list(f.attrs["moe_layer_indices"]) == [1, 2, 3]  # layer 0 of the demo is dense
        assert f["routed_experts"].dtype == np.uint8
        table = f["requests"][:]
        ids = [x.decode() if isinstance(x, bytes) else x for x in table["id"]]
        assert ids.count("fox") == 1 and len(ids) == 4
        for rec in table:
            assert rec["num_rows"] == rec["prompt_len"] + rec["output_len"] - 1
        assert f["routed_experts"].shape[0] == table["num_rows"].sum()
        assert f["token_ids"].shape[0] == (table["prompt_len"] + table["output_len"]).sum()
        fox = table[ids.index("fox")]
        assert fox["output_len"] == 5


@pytest.mark.skipif(shutil.which("h5ls") is None, reason="h5ls (hdf5-tools) not installed")
def test_h5ls_reads_the_trace(demo_trace):
    listing = subprocess.run(
        ["h5ls", "-r", str(demo_trace)], capture_output=True, text=True, check=True
    )
    for name in ("/routed_experts", "/token_ids", "/requests"):
        assert name in listing.stdout


def test_inspect_json_agrees_with_the_file(demo_trace):
    proc = moetrace("inspect", str(demo_trace), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    with h5py.File(demo_trace, "r") as f:
        rows = f["routed_experts"][:]
    assert info["requests"] == 4 and info["rows"] == rows.shape[0]
    for i, layer in enumerate(info["layer_load"]):
        counts = np.bincount(rows[:, i, :].ravel(), minlength=16)
        assert layer["max"] == counts.max() and layer["min"] == counts.min()


def test_inspect_table(demo_trace):
    proc = moetrace("inspect", str(demo_trace))
    assert proc.returncode == 0
    assert "Qwen3MoeForCausalLM" in proc.stdout and "max/mean" in proc.stdout


def test_stdin_is_read_when_prompts_is_dash(tmp_path):
    out = tmp_path / "s.h5"
    proc = moetrace("record", "demo", "-", "-o", str(out), "-q", stdin='{"prompt": "abc"}\n')
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert f["requests"].shape == (1,)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_malformed_line_names_file_and_line(tmp_path):
    prompts = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, '{"prompt": "oops"'])
    proc = moetrace("record", "demo", str(prompts), "-o", str(tmp_path / "o.h5"))
    assert_one_line_error(proc, "bad.jsonl:2", "JSON")
    assert not (tmp_path / "o.h5").exists()  # checked before any work started


def test_prompt_longer_than_context(tmp_path):
    prompts = write_jsonl(
        tmp_path / "long.jsonl", [{"prompt": "x"}, {"prompt_token_ids": [5] * 64}]
    )
    proc = moetrace(
        "record", "demo", str(prompts), "-o", str(tmp_path / "o.h5"), "--max-model-len", "32"
    )
    assert_one_line_error(proc, "long.jsonl:2", "prompt", "context")


def test_missing_model_directory(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    proc = moetrace("record", str(tmp_path / "nope"), str(prompts), "-o", str(tmp_path / "o.h5"))
    assert_one_line_error(proc, "no such model directory")


def test_unsupported_architecture_lists_supported(tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 2]}])
    proc = moetrace("record", str(model), str(prompts), "-o", str(tmp_path / "o.h5"))
    assert_one_line_error(proc, "LlamaForCausalLM", "Qwen3MoeForCausalLM")


def test_bad_stdin_line_keeps_the_finished_requests(tmp_path):
    out = tmp_path / "partial.h5"
    good = "".join(json.dumps({"id": f"g{i}", "prompt": "hello"}) + "\n" for i in range(3))
    proc = moetrace(
        "record", "demo", "-", "-o", str(out), "-q", "--max-num-seqs", "1", stdin=good + "{nope\n"
    )
    assert_one_line_error(proc, "<stdin>:4")
    with h5py.File(out, "r") as f:
        assert f["requests"].shape == (3,)
        assert not f.attrs["complete"]


def test_checkpoint_directory_records(tmp_path):
    """A real on-disk checkpoint (config.json + sharded safetensors + index) loads and records."""
    import torch
    from safetensors.torch import save_file

    from moetrace.models.loader import fill_dummy, instantiate

    config = tiny_qwen3_config()
    model = instantiate(config, "x", torch.float32, torch.device("cpu"))
    fill_dummy(model, 3, std=0.3)
    tensors = {}
    for name in model.expected_weight_names():
        tensors[name] = torch.randn(model.weights.destination(name).shape) * 0.3
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(ckpt / "model-00002-of-00002.safetensors"))
    weight_map = {
        n: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
        for i, n in enumerate(names)
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (ckpt / "config.json").write_text(json.dumps(config))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 2, 3]}])
    out = tmp_path / "c.h5"
    proc = moetrace("record", str(ckpt), str(prompts), "-o", str(out), "-q", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert f["routed_experts"].shape == (6, 2, 2)
    # A mis-shaped tensor is refused by name.
    bad = dict(tensors)
    bad["model.layers.0.mlp.gate.weight"] = torch.zeros(3, 3)
    save_file({n: bad[n] for n in names[:half]}, str(ckpt / "model-00001-of-00002.safetensors"))
    proc = moetrace("record", str(ckpt), str(prompts), "-o", str(tmp_path / "d.h5"))
    assert_one_line_error(proc, "model.layers.0.mlp.gate.weight", "shape")
