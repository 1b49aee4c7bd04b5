"""A checkpoint from a download is data: a bad ``config.json``, safetensors file or index
gets one line naming the file and what is wrong, before anything is allocated.

Each case is what the second fault campaign found ending in a traceback, in
unbounded memory, or (``rms_norm_eps: NaN``) in a trace of garbage with exit 0.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from support.reliability import (
    assert_one_line_error,
    run_cli,
    safetensors_checkpoint,
    tiny_checkpoint,
    tiny_tensors,
    write_jsonl,
)

PROMPTS = [{"prompt_token_ids": [1, 2, 3]}]


def _record(tmp_path: Path, ckpt: Path, *extra: str) -> tuple[int, str]:
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "t.h5"
    code, _, err = run_cli("record", str(ckpt), str(prompts), "-o", str(out), "-q", *extra)
    assert not out.exists(), "refused before any work: no file"
    return code, err


BAD_CONFIGS = {
    "num_experts 10^12": ({"num_experts": 10**12}, ("'num_experts'", "65,536")),
    "vocab_size 10^12": ({"vocab_size": 10**12}, ("'vocab_size'",)),
    "negative hidden_size": ({"hidden_size": -32}, ("'hidden_size'", "got -32")),
    "string hidden_size": ({"hidden_size": "32"}, ("'hidden_size'", 'got "32"')),
    "fractional hidden_size": ({"hidden_size": 32.5}, ("'hidden_size'", "got 32.5")),
    "top-k above the experts": ({"num_experts_per_tok": 9}, ("'num_experts_per_tok'", "8 experts")),
    "num_hidden_layers 10^9": ({"num_hidden_layers": 10**9}, ("'num_hidden_layers'",)),
    "rms_norm_eps NaN": ({"rms_norm_eps": float("nan")}, ("'rms_norm_eps'", "finite")),
    "rope_theta Infinity": ({"rope_theta": float("inf")}, ("'rope_theta'", "finite")),
    "heads that do not divide": ({"hidden_size": 30, "head_dim": None}, ("'hidden_size'",)),
    "odd head size": ({"hidden_size": 28, "head_dim": None}, ("'head_dim'", "even")),
    "kv heads that do not group": ({"num_key_value_heads": 3}, ("'num_key_value_heads'",)),
    "a value no range covers": (
        {"rope_parameters": {"rope_theta": "abc"}},
        ("config.json", "cannot build the model", "could not convert"),
    ),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_values_are_one_line_before_allocating(tmp_path, name):
    overrides, needles = BAD_CONFIGS[name]
    ckpt = tiny_checkpoint(tmp_path / "ck", **overrides)
    start = time.monotonic()
    code, err = _record(tmp_path, ckpt, "--load-format", "dummy")
    assert_one_line_error(code, err, "config.json", *needles)
    assert time.monotonic() - start < 30  # 10^9 layers allocated 5 GB over 35 s before


BAD_FILES = {
    "a JSON array": (b"[1, 2, 3]", "expected a JSON object, got an array"),
    "a binary file": (bytes(range(256)) * 8, "not UTF-8 text"),
    "50,000-deep nesting": (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    "a 4,300-digit integer": (b'{"hidden_size": ' + b"9" * 4400 + b"}", "not valid JSON"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_config_json_that_is_not_a_config(tmp_path, name):
    raw, needle = BAD_FILES[name]
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "config.json").write_bytes(raw)
    code, err = _record(tmp_path, ckpt, "--load-format", "dummy")
    assert_one_line_error(code, err, "config.json", needle)


# ------------------------------------------------------------------------- safetensors
@pytest.fixture(scope="module")
def tensors():
    return tiny_tensors()


def test_a_misshaped_tensor_is_refused_before_the_model_is_allocated(tmp_path, tensors):
    """hidden_size 4096 in config.json, the tiny weights on disk: no 4096-wide model is built."""
    ckpt = safetensors_checkpoint(tmp_path / "ck", tensors)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(hidden_size=4096, intermediate_size=1 << 16, moe_intermediate_size=1 << 16)
    (ckpt / "config.json").write_text(json.dumps(config))
    code, err = _record(tmp_path, ckpt, "--device", "cpu")
    assert_one_line_error(code, err, "model.safetensors", "expected", "shape")


def _lying_header(path: Path) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10**9  # points far past the end of the file
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "model.safetensors"),
        (lambda p: p.write_bytes(struct.pack("<Q", 10**12) + p.read_bytes()[8:]), "safetensors"),
        (_lying_header, "model.safetensors"),
        (
            lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"),
            "safetensors",
        ),
    ],
    ids=["truncated", "header length 10^12", "offsets past the end", "header not JSON"],
)
def test_damaged_safetensors_file_is_one_line(tmp_path, tensors, damage, needle):
    ckpt = safetensors_checkpoint(tmp_path / "ck", tensors)
    damage(ckpt / "model.safetensors")
    code, err = _record(tmp_path, ckpt)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize(
    "name",
    ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors"],
)
def test_index_entries_must_stay_inside_the_model_directory(tmp_path, tensors, name):
    ckpt = safetensors_checkpoint(tmp_path / "ck", tensors)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((ckpt / "model.safetensors").read_bytes())  # a valid file, elsewhere
    weight_map = {k: "model.safetensors" for k in tensors}
    weight_map[next(iter(tensors))] = name
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, err = _record(tmp_path, ckpt)
    assert_one_line_error(code, err, "model.safetensors.index.json", "outside the model directory")


@pytest.mark.parametrize(
    "text", ['["not", "an", "object"]', '{"weight_map": 3}', "{oops", '{"weight_map": {"a": 7}}']
)
def test_malformed_index_is_one_line(tmp_path, tensors, text):
    ckpt = safetensors_checkpoint(tmp_path / "ck", tensors)
    (ckpt / "model.safetensors.index.json").write_text(text)
    code, err = _record(tmp_path, ckpt)
    assert_one_line_error(code, err, "model.safetensors.index.json")


def test_a_linked_weight_file_outside_the_directory_still_loads(tmp_path, tensors):
    """The Hugging Face cache links each file to a blob elsewhere: names, not targets, count."""
    ckpt = safetensors_checkpoint(tmp_path / "ck", tensors)
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    (ckpt / "model.safetensors").rename(blob)
    (ckpt / "model.safetensors").symlink_to(blob)
    weight_map = {k: "model.safetensors" for k in tensors}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    code, _, err = run_cli("record", str(ckpt), str(prompts), "-o", str(tmp_path / "t.h5"), "-q")
    assert code == 0, err
