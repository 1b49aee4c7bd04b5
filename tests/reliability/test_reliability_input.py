"""Bad input: each case gets one line naming what is wrong, and nothing is lost.

Runs the real CLI entry point in this process (``run_cli``), which is what a
user meets minus the interpreter start, so the whole table stays fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import pytest
import torch
from support.reliability import (
    VOCAB,
    assert_one_line_error,
    record_args,
    run_cli,
    safetensors_checkpoint,
    tiny_checkpoint,
    tiny_tensors,
    token_prompts,
    write_jsonl,
)

from moetrace.trace.verify import verify_trace


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


OK = {"id": "ok", "prompt_token_ids": [1, 2, 3]}

# name -> (second prompt line, extra options, what the one-line error must contain)
BAD_LINES = {
    "malformed JSON": ('{"prompt_token_ids": [1, 2', (), ("p.jsonl:2", "not valid JSON")),
    "wrong type max_tokens": (
        {"prompt_token_ids": [1], "max_tokens": "ten"},
        (),
        ("p.jsonl:2", "'max_tokens'", "positive integer"),
    ),
    "wrong type token ids": (
        {"prompt_token_ids": "1 2 3"},
        (),
        ("p.jsonl:2", "'prompt_token_ids'"),
    ),
    "wrong type temperature": (
        {"prompt_token_ids": [1], "temperature": -1},
        (),
        ("p.jsonl:2", "'temperature'"),
    ),
    "unknown field": ({"prompt_token_ids": [1], "max_token": 3}, (), ("did you mean",)),
    "empty prompt": ({"prompt": ""}, (), ("p.jsonl:2", "empty prompt")),
    "empty token list": ({"prompt_token_ids": []}, (), ("p.jsonl:2", "empty token list")),
    "no prompt": ({"id": "x"}, (), ("p.jsonl:2", "no prompt")),
    "duplicate id": ({"id": "ok", "prompt_token_ids": [4]}, (), ("p.jsonl:2", "duplicate id")),
    "token id out of vocabulary": (
        {"prompt_token_ids": [1, VOCAB]},
        (),
        ("p.jsonl:2", "outside the vocabulary"),
    ),
    "negative token id": ({"prompt_token_ids": [1, -3]}, (), ("p.jsonl:2", "token id")),
    "text without tokenizer": ({"prompt": "hello"}, (), ("p.jsonl:2", "tokenizer.json")),
    "prompt longer than context": (
        {"prompt_token_ids": [5] * 40},
        ("--max-model-len", "32"),
        ("p.jsonl:2", "prompt has 40 tokens", "context is 32"),
    ),
    "max_tokens beyond context": (
        {"prompt_token_ids": [5] * 10, "max_tokens": 30},
        ("--max-model-len", "32"),
        ("p.jsonl:2", "'max_tokens'", "exceeds"),
    ),
    "invalid UTF-8": (b"\xff\xfe{}".decode("latin-1"), (), ("p.jsonl:2",)),
}


@pytest.mark.parametrize("name", list(BAD_LINES))
def test_bad_prompt_line_is_one_line_and_nothing_starts(tmp_path, model, name):
    line, extra, needles = BAD_LINES[name]
    path = tmp_path / "p.jsonl"
    if name == "invalid UTF-8":
        path.write_bytes(json.dumps(OK).encode() + b"\n\xff\xfe{}\n")
    else:
        write_jsonl(path, [OK, line])
    out = tmp_path / "t.h5"
    code, _, err = run_cli(*record_args(model, path, out, *extra))
    assert_one_line_error(code, err, *needles)
    assert not out.exists(), "checked before any work: no file"


@pytest.mark.parametrize("name", ["malformed JSON", "token id out of vocabulary", "empty prompt"])
def test_skip_invalid_records_the_rest_and_lists_the_skipped(tmp_path, model, name):
    line = BAD_LINES[name][0]
    path = write_jsonl(tmp_path / "p.jsonl", [OK, line, {"prompt_token_ids": [7, 8]}, line])
    out = tmp_path / "t.h5"
    code, _, err = run_cli(*record_args(model, path, out, "--skip-invalid"))
    assert code == 0, err
    assert "skipped" in err and "p.jsonl:2" in err and "p.jsonl:4" in err
    with h5py.File(out, "r") as f:
        assert f.attrs["complete"] and f["requests"].shape == (2,)
        skipped = json.loads(f.attrs["skipped_inputs"])
        assert [s["line"] for s in skipped] == [2, 4]
        assert all(s["source"].endswith("p.jsonl") and s["problem"] for s in skipped)
    report = verify_trace(out)
    assert report.status == "ok" and any("2 input line(s)" in n for n in report.notes)


def test_skip_invalid_on_standard_input(tmp_path, model):
    lines = [OK, '{"oops', {"prompt_token_ids": [VOCAB + 5]}, {"prompt_token_ids": [9]}]
    stdin = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    out = tmp_path / "s.h5"
    code, _, err = run_cli(*record_args(model, "-", out, "--skip-invalid"), stdin=stdin)
    assert code == 0, err
    with h5py.File(out, "r") as f:
        assert f["requests"].shape == (2,) and f.attrs["complete"]
        assert [s["line"] for s in json.loads(f.attrs["skipped_inputs"])] == [2, 3]


def test_bad_stdin_line_keeps_finished_requests_and_says_why(tmp_path, model):
    good = "".join(json.dumps(x) + "\n" for x in token_prompts(5))
    out = tmp_path / "s.h5"
    code, _, err = run_cli(
        *record_args(model, "-", out, "--max-num-seqs", "1"), stdin=good + "{nope\n"
    )
    assert_one_line_error(code, err, "<stdin>:6")
    report = verify_trace(out)
    assert report.status == "incomplete" and report.num_requests == 5
    assert report.end_reason.startswith("input error: <stdin>:6")


# --------------------------------------------------------------------------- run-level problems
def _prompts(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", [OK, {"prompt_token_ids": list(range(30))}])


@pytest.mark.parametrize(
    "extra, needles",
    [
        (("--pipeline-parallel-size", "2"), ("pipeline parallelism", "vLLM refuses it too")),
        (("--cpu-offload-gb", "4"), ("CPU weight offload", "vLLM refuses it too")),
        (("--pipeline-parallel-size", "0"), ("at least 1",)),
        (("--resume", "--overwrite"), ("exclude each other",)),
        (("--flush-every", "0"), ("--flush-every",)),
        (("--num-kv-blocks", "2", "--block-size", "4"), ("KV cache too small", "'1'", "p.jsonl:2")),
        (("--block-size", "3"), ("power of two",)),
        (("--device", "tpu"), ("unknown device",)),
        (("--dtype", "int4"), ("unknown dtype",)),
    ],
)
def test_unsupported_settings_refused_at_start(tmp_path, model, extra, needles):
    out = tmp_path / "t.h5"
    code, _, err = run_cli(*record_args(model, _prompts(tmp_path), out, *extra))
    assert_one_line_error(code, err, *needles)
    assert not out.exists()


def test_kv_cache_too_small_is_refused_before_the_file(tmp_path, model):
    # 30 prompt tokens + 16 new - 1 = 45 slots = 12 blocks of 4; give 11.
    out = tmp_path / "t.h5"
    code, _, err = run_cli(
        *record_args(model, _prompts(tmp_path), out, "--num-kv-blocks", "11", "--block-size", "4")
    )
    assert_one_line_error(code, err, "KV cache too small", "11 blocks of 4", "needs 45")
    assert not out.exists()
    code, _, err = run_cli(
        *record_args(model, _prompts(tmp_path), out, "--num-kv-blocks", "12", "--block-size", "4")
    )
    assert code == 0, err


def test_output_problems(tmp_path, model):
    prompts = _prompts(tmp_path)
    code, _, err = run_cli(*record_args(model, prompts, tmp_path / "no" / "t.h5"))
    assert_one_line_error(code, err, "no such directory")
    (tmp_path / "d.h5").mkdir()
    code, _, err = run_cli(*record_args(model, prompts, tmp_path / "d.h5", "--overwrite"))
    assert_one_line_error(code, err, "is a directory")
    (tmp_path / "exists.h5").write_bytes(b"precious")
    code, _, err = run_cli(*record_args(model, prompts, tmp_path / "exists.h5"))
    assert_one_line_error(code, err, "already exists", "--resume", "--overwrite")
    assert (tmp_path / "exists.h5").read_bytes() == b"precious"


def _read_only_dir(tmp_path: Path) -> Path | None:
    """A directory nobody may write: a read-only tmpfs as root, else chmod."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        if os.system(f"mount -t tmpfs -o ro,size=64k tmpfs {target} 2>/dev/null") != 0:
            return None
        return target
    target.chmod(0o500)
    return target


def test_output_directory_not_writable(tmp_path, model):
    target = _read_only_dir(tmp_path)
    if target is None:
        pytest.skip("cannot make a read-only directory here")
    try:
        code, _, err = run_cli(*record_args(model, _prompts(tmp_path), target / "t.h5"))
        # Root is refused only by a read-only mount, and is told so; others by the mode bits.
        why = "read-only file system" if os.geteuid() == 0 else "permission denied"
        assert_one_line_error(code, err, "cannot write", why)
    finally:
        if os.geteuid() == 0:
            os.system(f"umount {target}")


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def tensors():
    return tiny_tensors()


def test_checkpoint_missing_tensor(tmp_path, tensors):
    name = "model.layers.2.mlp.gate.weight"
    ckpt = safetensors_checkpoint(tmp_path / "ck", {k: v for k, v in tensors.items() if k != name})
    out = tmp_path / "t.h5"
    code, _, err = run_cli("record", str(ckpt), str(_prompts(tmp_path)), "-o", str(out), "-q")
    assert_one_line_error(code, err, "checkpoint lacks", name)
    assert not out.exists()


def test_checkpoint_misshaped_tensor(tmp_path, tensors):
    name = "model.layers.0.self_attn.q_proj.weight"
    ckpt = safetensors_checkpoint(tmp_path / "ck", {**tensors, name: torch.zeros(3, 5)})
    out = tmp_path / "t.h5"
    code, _, err = run_cli("record", str(ckpt), str(_prompts(tmp_path)), "-o", str(out), "-q")
    assert_one_line_error(code, err, name, "shape [3, 5]")
    assert not out.exists()


def test_checkpoint_without_weights_or_config(tmp_path):
    prompts = _prompts(tmp_path)
    ckpt = tiny_checkpoint(tmp_path / "bare")
    code, _, err = run_cli("record", str(ckpt), str(prompts), "-o", str(tmp_path / "a.h5"))
    assert_one_line_error(code, err, "no *.safetensors")
    (ckpt / "config.json").write_text("{not json")
    code, _, err = run_cli("record", str(ckpt), str(prompts), "-o", str(tmp_path / "b.h5"))
    assert_one_line_error(code, err, "config.json", "not valid JSON")
