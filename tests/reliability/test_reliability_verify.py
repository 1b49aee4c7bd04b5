"""``moetrace verify``: a truncated, partial or tampered trace is named precisely.

Traces here come straight from the writer (no model), so the whole table of
damage runs in a few seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest
from support.reliability import run_cli
from support.traces import make_metadata, mixed_requests

from moetrace.errors import MoetraceError
from moetrace.trace.records import REQUESTS, ROUTED_EXPERTS, TOKEN_IDS
from moetrace.trace.verify import verify_trace
from moetrace.trace.writer import TraceWriter

N = 30


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "ok.h5"
    md = make_metadata()
    with TraceWriter(path, md, chunk_rows=64, expected_requests=N) as w:
        for r in mixed_requests(md, n=N):
            w.submit(r)
    return path


@pytest.fixture
def trace(tmp_path, pristine) -> Path:
    path = tmp_path / "t.h5"
    shutil.copy(pristine, path)
    return path


def test_intact_trace_is_ok(pristine):
    report = verify_trace(pristine)
    assert report.status == "ok" and report.exit_code == 0 and not report.problems
    assert report.num_requests == N == report.expected_requests
    code, out, _ = run_cli("verify", str(pristine))
    assert code == 0 and "ok, complete" in out


def test_partial_trace_is_incomplete_not_damaged(tmp_path):
    md = make_metadata()
    reqs = mixed_requests(md, n=N)
    w = TraceWriter(tmp_path / "p.h5", md, chunk_rows=64, expected_requests=N).start()
    for r in reqs[:12]:
        w.submit(r)
    w.close(complete=False, end_reason="interrupted by SIGINT")
    report = verify_trace(tmp_path / "p.h5")
    assert report.status == "incomplete" and report.exit_code == 3
    assert report.end_reason == "interrupted by SIGINT"
    assert any(f"{N - 12} request(s) not recorded" in n for n in report.notes)
    code, out, _ = run_cli("verify", str(tmp_path / "p.h5"))
    assert code == 3 and "incomplete (interrupted by SIGINT): 12 of 30 requests" in out
    assert "--resume" in out


def test_rows_a_cut_flush_left_behind_are_counted(tmp_path):
    """Rows written before a kill stopped the flush that would have recorded them."""
    md = make_metadata()
    w = TraceWriter(tmp_path / "p.h5", md, chunk_rows=64, expected_requests=N).start()
    for r in mixed_requests(md, n=N)[:12]:
        w.submit(r)
    w.close(complete=False, end_reason="interrupted by SIGINT")
    with h5py.File(tmp_path / "p.h5", "a") as f:
        routed = f[ROUTED_EXPERTS]
        routed.resize(routed.shape[0] + 3, axis=0)
    report = verify_trace(tmp_path / "p.h5")
    assert report.status == "incomplete", report.problems
    assert "3 row(s) after the last record belong to no request" in report.notes


def _chunk_offset(path: Path, name: str, index: int = 0) -> int:
    with h5py.File(path, "r") as f:
        return f[name].id.get_chunk_info(index).byte_offset


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("dataset", [ROUTED_EXPERTS, TOKEN_IDS])
def test_flipped_data_byte_names_the_request(trace, dataset):
    _flip(trace, _chunk_offset(trace, dataset) + 5)
    report = verify_trace(trace)
    assert report.status == "damaged" and report.exit_code == 1
    assert len(report.problems) == 1
    assert report.problems[0].startswith("request 0 ('req-0-é'): checksum mismatch")


def test_flipped_expert_id_out_of_range_is_named(trace):
    with h5py.File(trace, "r+") as f:
        f[ROUTED_EXPERTS][3, 0, 0] = 200  # beyond num_experts=64, checksum now wrong as well
    problems = verify_trace(trace).problems
    assert len(problems) == 1 and "request 0" in problems[0]


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("id", b"renamed", "request table checksum mismatch"),
        ("finish_reason", 1, "request table checksum mismatch"),
        ("num_cached_tokens", 99, "request table checksum mismatch"),
        ("num_rows", 5, "rows for"),
        ("row_start", 3, "offsets"),
    ],
)
def test_edited_record_is_detected(trace, field, value, needle):
    with h5py.File(trace, "r+") as f:
        table = f[REQUESTS]
        rec = table[4]
        rec[field] = value
        table[4] = rec
    report = verify_trace(trace)
    assert report.status == "damaged"
    assert any(needle in p for p in report.problems), report.problems


def test_root_counts_that_disagree(trace):
    with h5py.File(trace, "r+") as f:
        f.attrs["num_rows"] = int(f.attrs["num_rows"]) + 1
    assert any("num_rows" in p for p in verify_trace(trace).problems)


def test_complete_but_fewer_requests_than_expected(trace):
    with h5py.File(trace, "r+") as f:  # drop the last record consistently: only the count tells
        table = f[REQUESTS]
        last = table[-1]
        table.resize(N - 1, axis=0)
        f[ROUTED_EXPERTS].resize(int(last["row_start"]), axis=0)
        f[TOKEN_IDS].resize(int(last["token_start"]), axis=0)
        f.attrs["num_requests"] = N - 1
        f.attrs["num_rows"] = int(last["row_start"])
        f.attrs["num_tokens"] = int(last["token_start"])
    problems = verify_trace(trace).problems
    assert any(
        f"marked complete with {N - 1} requests, but the run expected {N}" in p for p in problems
    )


def test_duplicate_request_id(tmp_path):
    md = make_metadata()
    reqs = mixed_requests(md, n=4)
    reqs[3].request_id = reqs[1].request_id
    with TraceWriter(tmp_path / "d.h5", md) as w:
        for r in reqs:
            w.submit(r)
    assert any("more than once" in p for p in verify_trace(tmp_path / "d.h5").problems)


@pytest.mark.parametrize("keep", [0.97, 0.6, 0.2, 0.01])
def test_truncated_file_is_damaged_not_a_traceback(trace, keep):
    size = trace.stat().st_size
    with open(trace, "r+b") as fh:
        fh.truncate(int(size * keep))
    report = verify_trace(trace)
    assert report.status == "damaged", report.summary()
    code, out, err = run_cli("verify", str(trace))
    assert code == 1 and "Traceback" not in out + err
    assert "damaged" in out


def test_not_a_trace(tmp_path):
    (tmp_path / "x.h5").write_text("hello")
    code, _, err = run_cli("verify", str(tmp_path / "x.h5"))
    assert code == 1 and err.strip() == f"error: not an HDF5 file: {tmp_path / 'x.h5'}"
    code, _, err = run_cli("verify", str(tmp_path / "missing.h5"))
    assert code == 1 and "no such trace file" in err


def test_json_report(trace):
    _flip(trace, _chunk_offset(trace, TOKEN_IDS) + 1)
    code, out, _ = run_cli("verify", str(trace), "--json")
    info = json.loads(out)
    assert code == 1 and info["status"] == "damaged" and info["requests"] == N
    assert info["problems"][0].startswith("request 0")


@pytest.mark.parametrize(
    "name, value, needle",
    [
        ("top_k", 3, "attributes say rows of 3 layers x top-3"),
        ("num_experts", 300, "need uint16"),
        ("created", "2020-01-01T00:00:00Z", "metadata checksum"),
        ("engine_settings", "{}", "metadata checksum"),
        ("model", "another/model", "metadata checksum"),
    ],
)
def test_edited_root_attribute_is_detected(trace, name, value, needle):
    with h5py.File(trace, "r+") as f:
        f.attrs[name] = value
    problems = verify_trace(trace).problems
    assert any(needle in p for p in problems), problems


def test_creation_leaves_no_half_written_file(tmp_path):
    """The header is written under a temporary name and renamed: a kill never leaves a stub."""
    md = make_metadata()
    w = TraceWriter(tmp_path / "t.h5", md).start()
    # Beside it while it is written: the writer's lock (trace/lock.py), gone once closed.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".t.h5.lock", "t.h5"]
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]
    (tmp_path / "u.h5").mkdir()
    with pytest.raises(MoetraceError, match="is a directory"):
        TraceWriter(tmp_path / "u.h5", md).start()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5", "u.h5"]


def test_table_and_metadata_checksums_follow_the_spec(pristine):
    """Recomputed from docs/trace-format.md with json and zlib only."""
    import zlib

    with h5py.File(pristine, "r") as f:
        crc = 0
        for rec in f[REQUESTS][: int(f.attrs["num_requests"])]:
            fields = [v.decode() if isinstance(v, bytes) else v.item() for v in rec]
            line = json.dumps(fields, separators=(",", ":"), ensure_ascii=False) + "\n"
            crc = zlib.crc32(line.encode(), crc)
        assert crc == f.attrs["requests_crc32"]
        names = ["format", "format_version", "model", "architecture", "config_digest",
                 "num_hidden_layers", "num_moe_layers", "moe_layer_indices", "num_experts",
                 "top_k", "vocab_size", "tokenizer", "dtype", "expert_id_dtype", "row_order",
                 "engine_settings", "moetrace_version", "created"]  # fmt: skip
        pairs = []
        for name in names:
            value = f.attrs[name]
            value = value.tolist() if hasattr(value, "tolist") else value
            pairs.append([name, value.decode() if isinstance(value, bytes) else value])
        text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=False)
        assert zlib.crc32(text.encode()) == f.attrs["metadata_crc32"]


needs_fork = pytest.mark.skipif(
    "fork" not in __import__("multiprocessing").get_all_start_methods(),
    reason="the stand-ins below reach the child through fork",
)


@needs_fork
@pytest.mark.parametrize(
    "behaviour, needle",
    [
        ("hang", "made no progress for 1 s"),
        ("crash", "HDF5 crashed reading it (exit code -11)"),
        ("raise", "KeyError"),
    ],
)
def test_guarded_verify_reports_a_stuck_or_crashing_hdf5(pristine, monkeypatch, behaviour, needle):
    """A flipped bit in a B-tree node can hang or crash HDF5 itself (seen in the campaign)."""
    import os
    import signal
    import time

    from moetrace.trace import verify as verify_module

    def stand_in(path, progress=None):
        if behaviour == "hang":
            time.sleep(60)
        if behaviour == "crash":
            __import__("faulthandler").disable()  # pytest's dump would only add noise
            os.kill(os.getpid(), signal.SIGSEGV)
        raise KeyError("attribute 'top_k' not found")

    monkeypatch.setattr(verify_module, "verify_trace", stand_in)
    start = time.monotonic()
    report = verify_module.verify_guarded(pristine, stall_s=1)
    assert report.status == "damaged" and needle in report.problems[0], report.problems
    assert time.monotonic() - start < 20


def test_guarded_verify_agrees_with_the_direct_one(pristine, trace):
    from moetrace.trace.verify import verify_guarded

    assert verify_guarded(pristine).to_dict() == verify_trace(pristine).to_dict()
    _flip(trace, _chunk_offset(trace, ROUTED_EXPERTS) + 9)
    assert verify_guarded(trace).to_dict() == verify_trace(trace).to_dict()
