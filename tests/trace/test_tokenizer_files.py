"""A trace reads as text on a machine that never had its model: it carries its tokenizer."""

from __future__ import annotations

import json
import shutil
import zlib

import h5py
import pytest
import tokenizers
from support.cli import moetrace
from support.reliability import run_cli, write_jsonl

from moetrace import open_trace
from moetrace.models.demo import DEMO_DIR
from moetrace.trace.checked_rows import DamagedTraceError


@pytest.fixture
def moved(tmp_path):
    """A trace recorded from a copy of the demo checkpoint, the copy deleted afterwards."""
    model = tmp_path / "model"
    shutil.copytree(DEMO_DIR, model)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hello, experts"}])
    code, _, err = run_cli("record", str(model), str(prompts), "-o", str(tmp_path / "t.h5"), "-q",
                           "--max-tokens", "4")  # fmt: skip
    assert code == 0, err
    original = {name: (model / name).read_bytes() for name in ("tokenizer.json",
                                                               "tokenizer_config.json")}  # fmt: skip
    shutil.rmtree(model)
    return tmp_path / "t.h5", original


def test_the_tokenizer_files_are_in_the_trace_for_plain_h5py(moved):
    trace, original = moved
    with h5py.File(trace, "r") as f:
        for name, data in original.items():
            stored = f["tokenizer"][name]
            assert bytes(stored[()]) == data and stored.attrs["crc32"] == zlib.crc32(data)
            assert stored.compression == "gzip"


def test_token_text_without_the_model(moved):
    trace, original = moved
    proc = moetrace("inspect", str(trace), "--request", "a", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["token_text"] == "the trace's tokenizer.json"
    tok = tokenizers.Tokenizer.from_str(original["tokenizer.json"].decode())
    entries = report["token_table"][0]["tokens"]
    escaped = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}  # as inspect shows them
    want = ["".join(escaped.get(c, c) for c in tok.decode([e["token"]])) for e in entries]
    assert [e["text"] for e in entries] == want
    assert "".join(e["text"] for e in entries[:14]) == "Hello, experts"


def test_a_damaged_tokenizer_file_is_reported(moved):
    trace, _ = moved
    with h5py.File(trace, "r+") as f:
        ds = f["tokenizer"]["tokenizer.json"]
        ds[10] = ds[10] ^ 0x20
    with open_trace(trace, verify=False) as t:
        assert t.verify() == ["tokenizer file 'tokenizer.json': checksum mismatch"]
    with pytest.raises(DamagedTraceError, match="tokenizer file 'tokenizer.json': checksum"):
        open_trace(trace)  # a reader refuses what verify calls damaged
    proc = moetrace("verify", str(trace))
    assert proc.returncode == 1 and "tokenizer file 'tokenizer.json': checksum mismatch" in (
        proc.stdout + proc.stderr
    )


def test_merge_and_older_traces(moved, tmp_path):
    trace, original = moved
    code, _, err = run_cli("merge", str(tmp_path / "m.h5"), str(trace))
    assert code == 0, err
    with open_trace(tmp_path / "m.h5") as merged:
        assert merged.tokenizer_files["tokenizer.json"] == original["tokenizer.json"]
    from support.legacy_traces import DATA, LEGACY_TRACES

    with open_trace(DATA / sorted(LEGACY_TRACES)[0]) as old:
        assert old.tokenizer_files == {} and old.verify() == []
