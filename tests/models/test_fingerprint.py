"""The sampled weights digest that lets ``--resume`` refuse other weights of the same layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.hf_reference import make_tiny_checkpoint
from support.reliability import assert_one_line_error, run_cli, token_prompts, write_jsonl

from moetrace.models import fingerprint
from moetrace.models.fingerprint import weights_digest
from moetrace.trace.resume import mismatches


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints with one config.json and differently seeded weights."""
    tmp = tmp_path_factory.mktemp("weights")
    a = make_tiny_checkpoint("qwen3_moe", tmp / "a", seed=1)
    b = make_tiny_checkpoint("qwen3_moe", tmp / "b", seed=2)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    return a, b


def test_digest_tells_checkpoints_of_one_layout_apart(checkpoints):
    a, b = checkpoints
    assert weights_digest(a, "safetensors") == weights_digest(a, "safetensors")
    assert weights_digest(a, "safetensors") != weights_digest(b, "safetensors")
    assert weights_digest(a, "dummy") == "dummy"


def test_sampled_blocks_cover_large_files(tmp_path, checkpoints, monkeypatch):
    """Past the whole-file size only sampled blocks are read: a byte inside one changes
    the digest, and the header is always hashed."""
    a, _ = checkpoints
    monkeypatch.setattr(fingerprint, "SAMPLES_PER_FILE", 4)
    monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 64)
    copy = Path(shutil.copytree(a, tmp_path / "copy"))
    before = weights_digest(copy, "safetensors")
    shard = copy / "model.safetensors"
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end + 10] ^= 0xFF  # inside the first sampled block
    shard.write_bytes(bytes(data))
    assert weights_digest(copy, "safetensors") != before


def test_resume_refuses_other_weights_of_the_same_layout(tmp_path, checkpoints):
    a, b = checkpoints
    prompts = write_jsonl(tmp_path / "p.jsonl", token_prompts(4, seed=1))
    out = tmp_path / "t.h5"
    args = ["-o", str(out), "-q", "--max-tokens", "3"]
    code, _, err = run_cli("record", str(a), str(prompts), *args)
    assert code == 0, err
    recorded = out.read_bytes()
    code, _, err = run_cli("record", str(b), str(prompts), *args, "--resume")
    assert_one_line_error(code, err, "cannot resume", "model weights")
    assert out.read_bytes() == recorded
    code, _, err = run_cli("record", str(a), str(prompts), *args, "--resume")
    assert code == 0, err


def test_traces_from_before_the_digest_are_not_refused_for_lacking_it():
    wanted = {"weights_digest": "sampled-sha256:ab", "seed": 0}
    assert mismatches({"seed": 0}, wanted) == []
    assert mismatches({"weights_digest": "sampled-sha256:cd", "seed": 0}, wanted) != []
