"""Reads that cannot be wrong: damaged routing is refused as it is read, naming the request.

After one byte of ``routed_experts`` changed, ``export``, ``inspect`` and
``open_trace(...).request()`` all succeeded; only ``verify`` noticed.  Each
case damages a real recorded trace and checks every way of reading it.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.corruption import corrupted_copies, guarded_cli, read_all_ways
from support.reliability import assert_one_line_error, reference_run, run_cli, write_jsonl

from moetrace import open_trace
from moetrace.trace.checked_rows import DamagedTraceError
from moetrace.trace.integrity import record_crc, request_checksum
from moetrace.trace.records import REQUESTS, ROUTED_EXPERTS, TOKEN_IDS

VICTIM = 5  # the record damaged in each case


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("reads"), 12, seed=2, max_tokens=5)[2]


def _copy(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "t.h5"
    shutil.copy(pristine, path)
    return path


def _flip_a_stored_byte(path: Path, dataset: str, row: int) -> None:
    """One byte changed on disk, under HDF5: the chunk's bytes, not a write through h5py."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        per = ds.chunks[0]
        info = ds.id.get_chunk_info_by_coord((row // per * per,) + (0,) * (ds.ndim - 1))
        itemsize = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
        offset = info.byte_offset + (row % per) * itemsize
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _victim(path: Path) -> tuple[str, int, int]:
    with open_trace(path, verify=False) as t:
        rec = t.requests[VICTIM]
        return str(rec["id"]), int(rec["row_start"]), int(rec["token_start"])


@pytest.mark.parametrize("dataset", [ROUTED_EXPERTS, TOKEN_IDS])
def test_one_changed_byte_is_refused_by_every_reader(tmp_path, pristine, dataset):
    path = _copy(pristine, tmp_path)
    rid, row, token = _victim(path)
    _flip_a_stored_byte(path, dataset, row + 1 if dataset == ROUTED_EXPERTS else token + 1)
    needle = f"request {VICTIM} ({rid!r}) is damaged: checksum mismatch"
    with open_trace(path) as t:
        with pytest.raises(DamagedTraceError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            t.request(VICTIM)
        t.request(VICTIM - 1)  # the others read as before
        with pytest.raises(DamagedTraceError):
            list(t)
        with pytest.raises(DamagedTraceError):
            list(t.iter_row_chunks())
    with open_trace(path, verify=False) as t:  # the explicit opt-out hands it on
        t.request(VICTIM)
    for command in (["export", str(path)], ["inspect", str(path)]):
        code, _, err = run_cli(*command)
        assert_one_line_error(code, err, needle)
        code, _, err = run_cli(*command, "--no-verify-checksums")
        assert code == 0, err
    code, out, err = run_cli("inspect", str(path), "--request", rid, "--json")
    assert_one_line_error(code, err, needle)
    code, out, err = run_cli("inspect", str(path), "--range", f"0:{VICTIM}", "--json")
    assert code == 0, err  # only the chosen requests are read, and they are intact


def test_an_expert_id_past_the_experts_is_refused_even_with_a_matching_checksum(tmp_path, pristine):
    """export wrote expert id 31 of 16 experts without a word."""
    path = _copy(pristine, tmp_path)
    with h5py.File(path, "r+") as f:
        table = f[REQUESTS]
        rec = table[VICTIM]
        r0, n = int(rec["row_start"]), int(rec["num_rows"])
        t0, m = int(rec["token_start"]), int(rec["prompt_len"] + rec["output_len"])
        rows = f[ROUTED_EXPERTS][r0 : r0 + n]
        rows[0, 0, 0] = int(f.attrs["num_experts"]) + 23
        f[ROUTED_EXPERTS][r0 : r0 + n] = rows
        rec["checksum"] = request_checksum(rows, f[TOKEN_IDS][t0 : t0 + m])
        table[VICTIM] = rec
        f.attrs["requests_crc32"] = record_crc(table[:])  # every checksum agrees
    experts = None
    with open_trace(path, verify=False) as t:
        experts = t.num_experts
    for command in (["export", str(path)], ["inspect", str(path)]):
        code, _, err = run_cli(*command)
        assert_one_line_error(code, err, f"expert id {experts + 23} >= num_experts {experts}")


def test_an_altered_request_record_is_refused_on_open(tmp_path, pristine):
    """A record's id is outside its data checksum; the table's own checksum covers it."""
    path = _copy(pristine, tmp_path)
    with h5py.File(path, "r+") as f:
        rec = f[REQUESTS][VICTIM]
        rec["id"] = b"someone-else"
        f[REQUESTS][VICTIM] = rec
    for command in (["export", str(path)], ["inspect", str(path)]):
        code, _, err = run_cli(*command)
        assert_one_line_error(code, err, "is damaged: request table checksum mismatch")
        assert run_cli(*command, "--no-verify-checksums")[0] == 0


def test_a_flipped_bit_in_a_json_attribute_is_one_line(tmp_path, pristine):
    """It ended in a JSONDecodeError traceback in inspect and export."""
    path = _copy(pristine, tmp_path)
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"block_size": ') + len(b'"block_size"')  # in engine_settings' text
    raw[at] ^= 0x01  # ":" becomes ";": no longer JSON
    path.write_bytes(bytes(raw))
    for command in (["export", str(path)], ["inspect", str(path)]):
        for extra in ((), ("--no-verify-checksums",)):
            code, _, err = run_cli(*command, *extra)
            assert_one_line_error(code, err, "t.h5", "damaged")


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory) -> Path:
    """A real trace of the demo model: text prompts, its tokenizer files stored inside."""
    tmp = tmp_path_factory.mktemp("demo")
    prompts = write_jsonl(
        tmp / "p.jsonl",
        [{"id": f"d{i}", "prompt": f"Tell me about expert number {i}."} for i in range(8)]
        + [{"id": "n2", "prompt": "Two samples", "n": 2, "temperature": 1.0, "seed": 3}],
    )
    code, _, err = run_cli(
        "record", "demo", str(prompts), "-o", str(tmp / "demo.h5"), "-q", "--max-tokens", "5"
    )
    assert code == 0, err
    return tmp / "demo.h5"


CORRUPTED = 54  # 6 of each kind: a flipped bit in each region, anywhere, a truncation


@pytest.mark.slow
def test_readers_refuse_every_file_verify_calls_damaged(demo_trace, tmp_path):
    """For each corrupted copy: verify's verdict and export's and inspect's exit codes agree,
    in one line and never a traceback, hang or crash.

    The outside attack found export exit 0 on 29 of 53 damaged files and inspect on 15,
    and tracebacks; a flipped bit in a stored tokenizer file still did both.
    """
    assert read_all_ways(demo_trace).verify == "ok"  # the intact file reads everywhere
    verdicts: Counter = Counter()
    failures = []
    for i, (what, data) in enumerate(corrupted_copies(demo_trace, CORRUPTED, random.Random(18))):
        path = tmp_path / f"c{i}.h5"
        path.write_bytes(data)
        readings = read_all_ways(path)
        verdicts[readings.verify] += 1
        failures += [f"{what}: {d}" for d in readings.disagreements()]
        path.unlink()
    assert not failures, "\n".join(failures)
    assert verdicts["damaged"] + verdicts["refused"] >= CORRUPTED // 2, verdicts  # aimed flips hit


def test_a_trace_with_several_samples_of_a_prompt_is_not_called_damaged(demo_trace):
    """The samples of one prompt share its id: verify called that "recorded more than once"."""
    code, out, err = run_cli("verify", str(demo_trace))
    assert code == 0, out + err
    with open_trace(demo_trace) as t:
        assert sorted(t.sample_indices[t.requests["id"] == "n2"].tolist()) == [0, 1]


def test_an_hdf5_possibly_corrupted_error_is_one_line(demo_trace, tmp_path):
    """A traceback in the outside attack: HDF5's "possibly corrupted file" on a damaged
    attribute header.  The size field of one attribute's datatype gets bit 23 set."""
    raw = bytearray(demo_trace.read_bytes())
    name = b"num_experts\x00"
    assert raw.count(name) == 1
    at = raw.index(name) + len(name)
    assert raw[at + 4 : at + 12] == bytes.fromhex("1008000008000000")  # int64, 8 bytes
    raw[at + 10] ^= 0x80
    path = tmp_path / "t.h5"
    path.write_bytes(bytes(raw))
    for command in (["export", str(path)], ["inspect", str(path)], ["verify", str(path)]):
        for extra in ((), ("--no-verify-checksums",)) if command[0] != "verify" else ((),):
            code, out, err = run_cli(*command, *extra)
            text = err if command[0] != "verify" else out + err
            assert code == 1 and "Traceback" not in text, text
            assert "possibly corrupted" in text and "damaged" in text, text


@pytest.mark.parametrize("name", [b"created\x00", b"sampling_params\x00"])
def test_a_damaged_string_type_is_refused_not_crashed_on(demo_trace, tmp_path, name):
    """HDF5 crashed (signal 11) reading a string whose variable-length type had one bit
    flipped into a sequence's: the corruption campaign hit it in the attribute ``created``;
    the request table's string columns hold the same type."""
    raw = bytearray(demo_trace.read_bytes())
    at = raw.index(bytes([0x19, 0x01]), raw.index(name))  # variable length (9), string (1)
    raw[at + 1] ^= 0x02
    path = tmp_path / "t.h5"
    path.write_bytes(bytes(raw))
    for command in ("export", "inspect"):
        code, err = guarded_cli(command, str(path))
        assert_one_line_error(code, err, "damaged datatype")
