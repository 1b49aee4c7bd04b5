"""Trace files: what is submitted comes back, through moetrace and through plain h5py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.traces import CHUNK, make_metadata, make_request, mixed_requests

from moetrace import open_trace
from moetrace.errors import MoetraceError
from moetrace.trace import chunk_appender, trace_file
from moetrace.trace.metadata import FORMAT_NAME, FORMAT_VERSION, TraceMetadata
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, md: TraceMetadata, reqs, **kw) -> TraceWriter:
    kw = {"chunk_rows": CHUNK, "flush_every_requests": 7, **kw}
    with TraceWriter(path, md, **kw) as w:
        for r in reqs:
            w.submit(r)
    return w


@pytest.fixture
def written(tmp_path):
    md = make_metadata()
    reqs = mixed_requests(md)
    path = tmp_path / "trace.h5"
    w = write(path, md, reqs)
    return path, md, reqs, w


def assert_same(got, want: FinishedRequest) -> None:
    assert got.id == want.request_id
    assert got.index == want.index
    assert got.finish_reason == want.finish_reason
    assert got.num_cached_tokens == want.num_cached_tokens
    assert got.num_preemptions == want.num_preemptions
    assert got.extra == want.extra
    np.testing.assert_array_equal(got.prompt_token_ids, want.prompt_token_ids)
    np.testing.assert_array_equal(got.output_token_ids, want.output_token_ids)
    assert got.routed_experts.dtype == want.routed_experts.dtype
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)


def test_round_trip(written):
    path, md, reqs, w = written
    assert (w.written_requests, w.flushed_requests) == (len(reqs), len(reqs))
    assert w.written_rows == sum(r.num_rows for r in reqs)
    assert max(r.num_rows for r in reqs) > 3 * CHUNK
    assert any(r.output_len == 0 for r in reqs)
    with open_trace(path) as t:
        assert t.complete and t.num_dropped == 0
        assert len(t) == t.num_requests == len(reqs)
        assert t.num_rows == sum(r.num_rows for r in reqs)
        assert t.num_tokens == sum(r.prompt_len + r.output_len for r in reqs)
        assert t.request_ids == [r.request_id for r in reqs]
        for got, want in zip(t, reqs, strict=True):
            assert_same(got, want)
        for i in (0, 5, len(reqs) - 1):
            assert_same(t.request(i), reqs[i])
            assert_same(t.request(reqs[i].request_id), reqs[i])
        assert_same(t.request(-1), reqs[-1])
        with pytest.raises(IndexError):
            t.request(len(reqs))
        with pytest.raises(KeyError):
            t.request("nope")
        assert t.verify() == []


def test_metadata(written):
    path, md, reqs, _ = written
    with open_trace(path) as t:
        m = t.metadata
    # Version 1: a trace without the optional arrays keeps the version older readers read.
    assert m["format"] == FORMAT_NAME and m["format_version"] == 1 < FORMAT_VERSION
    assert m["model"] == md.model and m["architecture"] == md.architecture
    assert m["moe_layer_indices"] == md.moe_layer_indices
    assert (m["num_moe_layers"], m["num_experts"], m["top_k"]) == (3, 64, 4)
    assert m["expert_id_dtype"] == "uint8" and m["row_order"] == "router"
    assert m["engine_settings"] == md.engine_settings and m["tokenizer"] == ""
    assert m["moetrace_version"] == "9.9.9" and m["complete"] is True
    assert m["created"].endswith("Z") and m["created"][:2] == "20"
    assert m["num_requests"] == len(reqs)
    assert m["num_rows"] == sum(r.num_rows for r in reqs)


def test_row_chunks_stream_every_row(written):
    path, _, reqs, _ = written
    want = np.concatenate([r.routed_experts for r in reqs])
    with open_trace(path) as t:
        for chunk_rows in (None, 50, CHUNK):
            parts = list(t.iter_row_chunks(chunk_rows))
            assert [s for s, _ in parts] == list(np.cumsum([0] + [len(a) for _, a in parts])[:-1])
            np.testing.assert_array_equal(np.concatenate([a for _, a in parts]), want)


def test_plain_h5py_reads_the_same(written):
    """The format spec's example, without moetrace's reader."""
    path, md, reqs, _ = written
    with h5py.File(path, "r") as f:
        routed, tokens, table = f["routed_experts"], f["token_ids"], f["requests"][:]
        assert routed.chunks == (CHUNK, 3, 4) and routed.maxshape == (None, 3, 4)
        assert routed.dtype == np.uint8 and tokens.dtype == np.int32
        assert routed.compression is None
        names = {
            v: k for k, v in h5py.check_enum_dtype(f["requests"].dtype["finish_reason"]).items()
        }
        for i, want in enumerate(reqs):
            rec = table[i]
            assert rec["id"].decode() == want.request_id
            r0, n = rec["row_start"], rec["num_rows"]
            t0, p, o = rec["token_start"], rec["prompt_len"], rec["output_len"]
            np.testing.assert_array_equal(routed[r0 : r0 + n], want.routed_experts)
            np.testing.assert_array_equal(tokens[t0 : t0 + p], want.prompt_token_ids)
            np.testing.assert_array_equal(tokens[t0 + p : t0 + p + o], want.output_token_ids)
            assert names[rec["finish_reason"]] == want.finish_reason
            assert json.loads(rec["extra"] or b"{}") == want.extra


def test_offsets_are_csr(written):
    path, _, reqs, _ = written
    with open_trace(path) as t:
        table = t.requests
    rows = [r.num_rows for r in reqs]
    toks = [r.prompt_len + r.output_len for r in reqs]
    assert table["row_start"].tolist() == np.cumsum([0, *rows])[:-1].tolist()
    assert table["token_start"].tolist() == np.cumsum([0, *toks])[:-1].tolist()
    assert table["num_rows"].tolist() == rows
    assert table["prompt_len"].tolist() == [r.prompt_len for r in reqs]
    assert table["index"].tolist() == list(range(len(reqs)))


def test_checksum_definition(written):
    path, _, reqs, _ = written
    with open_trace(path) as t:
        stored = t.requests["checksum"]
    for got, r in zip(stored, reqs, strict=True):
        data = r.routed_experts.tobytes() + r.prompt_token_ids.astype("<i4").tobytes()
        assert got == zlib.crc32(data + r.output_token_ids.astype("<i4").tobytes())


@pytest.mark.parametrize("dataset", ["routed_experts", "token_ids"])
def test_tampered_byte_is_detected(written, dataset):
    path, _, reqs, _ = written
    victim = 6
    with h5py.File(path, "r+") as f:
        rec = f["requests"][victim]
        at = rec["row_start"] + 1 if dataset == "routed_experts" else rec["token_start"]
        f[dataset][at] = f[dataset][at] ^ 1
    with open_trace(path) as t:
        problems = t.verify()
    assert len(problems) == 1
    assert f"request {victim} " in problems[0] and "checksum mismatch" in problems[0]


def test_uint16_for_more_than_256_experts(tmp_path):
    md = make_metadata(num_experts=300, layers=2, top_k=2)
    rng = np.random.default_rng(1)
    reqs = [make_request(rng, md, i, 30 + i, 5) for i in range(5)]
    reqs[0].routed_experts[0, 0] = [299, 256]
    write(tmp_path / "t.h5", md, reqs)
    with open_trace(tmp_path / "t.h5") as t:
        assert t.metadata["expert_id_dtype"] == "uint16"
        for got, want in zip(t, reqs, strict=True):
            assert_same(got, want)
        assert t.request(0).routed_experts[0, 0].tolist() == [299, 256]


def test_gzip_compression(tmp_path):
    md = make_metadata()
    reqs = mixed_requests(md, n=12)
    write(tmp_path / "t.h5", md, reqs, compression="gzip")
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert f["routed_experts"].compression == "gzip"
    with open_trace(tmp_path / "t.h5") as t:
        for got, want in zip(t, reqs, strict=True):
            assert_same(got, want)
        assert t.verify() == []


def test_empty_trace(tmp_path):
    write(tmp_path / "t.h5", make_metadata(), [])
    with open_trace(tmp_path / "t.h5") as t:
        assert (len(t), t.num_rows, t.num_tokens, t.complete) == (0, 0, 0, True)
        assert list(t) == [] and list(t.iter_row_chunks()) == [] and t.verify() == []


def test_complete_false(tmp_path):
    md = make_metadata()
    w = TraceWriter(tmp_path / "a.h5", md).start()
    w.submit(mixed_requests(md, n=2)[1])
    w.close(complete=False)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert not f.attrs["complete"] and f.attrs["num_requests"] == 1
    with pytest.raises(RuntimeError, match="boom"), TraceWriter(tmp_path / "b.h5", md):
        raise RuntimeError("boom")
    with open_trace(tmp_path / "b.h5") as t:
        assert t.complete is False and len(t) == 0


def test_flushes_on_interval(tmp_path):
    md = make_metadata()
    reqs = mixed_requests(md, n=3)
    kw = {"flush_interval_s": 0.05, "flush_every_requests": 1000}
    with TraceWriter(tmp_path / "t.h5", md, **kw) as w:
        for r in reqs:
            w.submit(r)
        deadline = time.monotonic() + 5
        while w.flushed_requests < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.flushed_requests == 3


def test_error_in_writer_thread_surfaces(tmp_path, monkeypatch):
    def fail(self, offset, data):
        raise OSError("no space left on device")

    monkeypatch.setattr(chunk_appender.ChunkAppender, "_write", fail)
    md = make_metadata()
    reqs = mixed_requests(md, n=30)
    w = TraceWriter(tmp_path / "t.h5", md, queue_size=1, flush_every_requests=1).start()
    with pytest.raises(MoetraceError, match="no space left on device") as info:
        for r in reqs:  # a dead thread must not leave submit blocked on the full queue
            w.submit(r)
        w.close()
    assert str(tmp_path / "t.h5") in str(info.value)
    w.close()  # reported once, and close still returns
    with open_trace(tmp_path / "t.h5") as t:
        assert not t.complete


def test_submit_blocked_on_a_full_queue_is_released_by_a_failure(tmp_path, monkeypatch):
    def slow_failure(self, batch):
        time.sleep(0.2)  # long enough for the caller to block on the full queue
        raise OSError("disk gone")

    monkeypatch.setattr(trace_file.TraceFile, "place", slow_failure)
    md = make_metadata()
    w = TraceWriter(tmp_path / "t.h5", md, queue_size=1).start()
    raised = []

    def submit_all():
        try:
            for r in mixed_requests(md, n=4):
                w.submit(r)
        except MoetraceError as exc:
            raised.append(exc)

    caller = threading.Thread(target=submit_all, daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert not caller.is_alive(), "submit stayed blocked after the writer thread died"
    assert raised and "disk gone" in str(raised[0])
    w.close()


def test_bug_in_writer_thread_keeps_its_type(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_file, "request_checksum", lambda *a: 1 / 0)
    md = make_metadata()
    w = TraceWriter(tmp_path / "t.h5", md).start()
    w.submit(mixed_requests(md, n=1)[0])
    with pytest.raises(ZeroDivisionError):
        w.close()


def test_failure_in_a_batch_that_took_the_close_message_still_returns(tmp_path, monkeypatch):
    """Requests and the close message queued before the thread runs are taken as one batch;
    a failure placing them must not leave the thread (and ``close``) waiting for the close."""
    loop = TraceWriter._loop

    def late_loop(self, file):
        self.queued.wait(5)  # everything, close included, is queued first
        return loop(self, file)

    monkeypatch.setattr(TraceWriter, "_loop", late_loop)
    monkeypatch.setattr(trace_file, "request_checksum", lambda *a: 1 / 0)
    md = make_metadata()
    w = TraceWriter(tmp_path / "t.h5", md)
    w.queued = threading.Event()
    w.start()
    for r in mixed_requests(md, n=3):
        w.submit(r)
    threading.Timer(0.2, w.queued.set).start()
    raised = []

    def close():
        try:
            w.close()
        except ZeroDivisionError as exc:
            raised.append(exc)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive(), "close stayed blocked after the writer thread failed"
    assert raised, "the thread's failure did not reach close()"


def test_a_burst_of_requests_is_written_in_few_writes(tmp_path, monkeypatch):
    """Requests queued together go to each dataset in whole multi-chunk writes, not one or
    more writes per request; the trace reads back the same."""
    writes = []
    write = chunk_appender.ChunkAppender._write

    def counting(self, offset, data):
        writes.append((self.ds.name, len(data)))
        return write(self, offset, data)

    monkeypatch.setattr(chunk_appender.ChunkAppender, "_write", counting)
    md = make_metadata()
    reqs = mixed_requests(md, n=60)
    with TraceWriter(tmp_path / "t.h5", md, chunk_rows=CHUNK, flush_every_requests=1000) as w:
        for r in reqs:
            w.submit(r)
    rows = sum(r.num_rows for r in reqs)
    row_writes = [n for name, n in writes if name == "/routed_experts"]
    assert sum(row_writes) >= rows and len(row_writes) < len(reqs) // 4
    with open_trace(tmp_path / "t.h5") as t:
        for want, got in zip(reqs, t, strict=True):
            np.testing.assert_array_equal(got.routed_experts, want.routed_experts)


def test_unwritable_path(tmp_path):
    md = make_metadata()
    for path in (tmp_path / "missing-dir" / "t.h5", tmp_path):
        with pytest.raises(MoetraceError) as info:
            TraceWriter(path, md).start()
        assert str(path) in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "old.h5").write_bytes(b"precious")
    with pytest.raises(MoetraceError, match="already exists"):
        TraceWriter(tmp_path / "old.h5", md).start()
    assert (tmp_path / "old.h5").read_bytes() == b"precious"
    write(tmp_path / "old.h5", md, [], overwrite=True)
    assert open_trace(tmp_path / "old.h5").complete


def test_bad_requests_are_refused_at_submit(tmp_path):
    md = make_metadata()
    rng = np.random.default_rng(2)
    bad = [
        make_request(rng, md, 0, 10, 5, rows=13),  # a finished request needs 14 rows
        make_request(rng, md, 1, 10, 5, "abort", rows=16),
        make_request(rng, md, 2, 10, 5, "timeout"),
    ]
    wide = make_request(rng, md, 3, 10, 5)
    wide.routed_experts = wide.routed_experts.astype(np.int32)
    short = make_request(rng, md, 4, 10, 5)
    short.routed_experts = short.routed_experts[:, :2]
    with TraceWriter(tmp_path / "t.h5", md) as w:
        for r in [*bad, wide, short]:
            with pytest.raises(ValueError, match=r.request_id):
                w.submit(r)


def test_reader_refuses(tmp_path):
    with pytest.raises(MoetraceError, match=f"^no such trace file: {tmp_path / 'x.h5'}$"):
        open_trace(tmp_path / "x.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(MoetraceError, match="not an HDF5 file"):
        open_trace(tmp_path / "text.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(MoetraceError, match="not a moetrace trace.*other.h5"):
        open_trace(tmp_path / "other.h5")
    write(tmp_path / "new.h5", make_metadata(), [])
    with h5py.File(tmp_path / "new.h5", "r+") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(MoetraceError, match="newer.*new.h5"):
        open_trace(tmp_path / "new.h5")


def test_record_past_the_data_is_left_out(tmp_path):
    """What a kill between the data and its record can leave: a tail record not backed by data."""
    md = make_metadata()
    reqs = mixed_requests(md, n=8)
    w = TraceWriter(tmp_path / "t.h5", md).start()
    for r in reqs:
        w.submit(r)
    w.close(complete=False)
    with h5py.File(tmp_path / "t.h5", "r+") as f:
        table = f["requests"]
        table.resize(len(reqs) + 2, axis=0)
        ghost = table[len(reqs) - 1]
        ghost["row_start"] += ghost["num_rows"]
        table[len(reqs)] = ghost  # points past the end of the rows
        ghost["checksum"] ^= 1
        ghost["row_start"] = 0
        table[len(reqs) + 1] = ghost  # in range, wrong checksum
    with open_trace(tmp_path / "t.h5") as t:
        assert (len(t), t.num_dropped) == (len(reqs), 2)
        for got, want in zip(t, reqs, strict=True):
            assert_same(got, want)
        assert len(t.verify()) == 1 and "left out" in t.verify()[0]


CRASHING_WRITER = """
import os, signal, sys, time
import numpy as np
sys.path.insert(0, {tests!r})
from support.traces import make_metadata, mixed_requests
from moetrace.trace.writer import TraceWriter
md = make_metadata()
reqs = mixed_requests(md, n=60)
w = TraceWriter({path!r}, md, chunk_rows=64, flush_every_requests=5).start()
for r in reqs[:50]:
    w.submit(r)
while w.flushed_requests < 50:
    time.sleep(0.005)
for r in reqs[50:]:
    w.submit(r)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_leaves_a_readable_prefix(tmp_path):
    path = tmp_path / "killed.h5"
    code = CRASHING_WRITER.format(tests=str(REPO / "tests"), path=str(path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    reqs = mixed_requests(make_metadata(), n=60)
    with open_trace(path) as t:
        assert not t.complete and 50 <= len(t) <= 60
        assert t.verify() == []
        for got, want in zip(t, reqs, strict=False):
            assert_same(got, want)


def test_hdf5_tools_read_the_file(written):
    h5ls, h5dump = shutil.which("h5ls"), shutil.which("h5dump")
    if not (h5ls and h5dump):
        pytest.skip("h5ls/h5dump not installed (apt-get install hdf5-tools)")
    path, _, reqs, _ = written
    rows = sum(r.num_rows for r in reqs)
    out = subprocess.run([h5ls, "-r", str(path)], capture_output=True, text=True, check=True)
    assert f"/routed_experts          Dataset {{{rows}/Inf, 3, 4}}" in out.stdout
    assert f"/requests                Dataset {{{len(reqs)}/Inf}}" in out.stdout
    assert "/token_ids" in out.stdout
    out = subprocess.run([h5dump, "-d", "/requests", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"req-5-' in out.stdout and "abort," in out.stdout and "H5T_ENUM" in out.stdout
    out = subprocess.run([h5dump, "-A", str(path)], capture_output=True, text=True, check=True)
    assert f'"{FORMAT_NAME}"' in out.stdout and '"router"' in out.stdout


def test_format_spec_example_runs(written, monkeypatch):
    path, _, reqs, _ = written
    doc = (REPO / "docs" / "trace-format.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(path.parent)
    scope: dict = {}
    exec(compile(code, "trace-format.md", "exec"), scope)
    np.testing.assert_array_equal(scope["experts"], reqs[0].routed_experts)
    np.testing.assert_array_equal(scope["output"], reqs[0].output_token_ids)


def test_damaged_offsets_are_reported(written):
    path, _, reqs, _ = written
    with h5py.File(path, "r+") as f:
        rec = f["requests"][3]
        rec["row_start"] = 0
        f["requests"][3] = rec
    with pytest.raises(MoetraceError, match="request table checksum mismatch"):
        open_trace(path)  # read as usual, the altered table is refused on open
    with open_trace(path, verify=False) as t:
        problems = t.verify()
        assert len(problems) == 1 and problems[0].startswith("request 3 ")
        assert "offsets are not the running sums" in problems[0]
        got = list(t)
    for i in (2, 4):
        assert_same(got[i], reqs[i])
    np.testing.assert_array_equal(got[3].routed_experts, reqs[0].routed_experts[: reqs[3].num_rows])


def test_ids_hdf5_cannot_hold_are_escaped_and_the_batch_is_kept(tmp_path):
    """A NUL or a lone surrogate in one id once failed the whole batch's write (and the file)."""
    from moetrace.trace.verify import verify_trace

    md = make_metadata()
    rng = np.random.default_rng(3)
    reqs = [make_request(rng, md, i, 5, 3) for i in range(6)]
    reqs[1].request_id = "nul\x00id"
    reqs[4].request_id = "bad\ud800id"
    path = tmp_path / "t.h5"
    write(path, md, reqs, flush_every_requests=3)
    assert verify_trace(path).status == "ok"
    with open_trace(path) as t:
        got = list(t)
    assert [r.id for r in got] == [r.request_id for r in reqs[:1]] + ["nul\\x00id"] + [
        r.request_id for r in reqs[2:4]
    ] + ["bad\\ud800id", reqs[5].request_id]
    for g, want in zip(got, reqs, strict=True):
        np.testing.assert_array_equal(g.routed_experts, want.routed_experts)


def test_reserve_zero_still_keeps_a_flushs_room(tmp_path, monkeypatch):
    """With the reserve off the writer still stops before HDF5 meets a full disk."""
    md = make_metadata()
    rng = np.random.default_rng(4)
    room = [10 << 20]
    monkeypatch.setattr(trace_file, "free_bytes", lambda path: room[0])
    path = tmp_path / "t.h5"
    w = TraceWriter(path, md, chunk_rows=CHUNK, flush_every_requests=1, reserve_bytes=0).start()
    w.submit(make_request(rng, md, 0, 5, 3))
    deadline = time.monotonic() + 10
    while w.flushed_requests < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.healthy
    room[0] = trace_file.FLUSH_METADATA_BYTES  # less than a flush needs: not a byte is written
    w.submit(make_request(rng, md, 1, 5, 3))
    deadline = time.monotonic() + 10
    while w.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not w.healthy  # what the server's /health reads
    with pytest.raises(MoetraceError, match="disk full"):
        w.close(complete=False)
    with open_trace(path) as t:
        assert [r.id for r in t] == [make_request(np.random.default_rng(4), md, 0, 5, 3).request_id]


def test_a_directory_is_not_called_missing(tmp_path):
    from support.cli import moetrace

    for command in (["inspect"], ["export"], ["verify"]):
        proc = moetrace(*command, str(tmp_path))
        assert proc.returncode == 1, (command, proc.stderr)
        assert proc.stderr.splitlines() == [f"error: {tmp_path} is a directory, not a trace file"]
    proc = moetrace("inspect", str(tmp_path / "nothing.h5"))
    assert proc.stderr.splitlines() == [f"error: no such trace file: {tmp_path / 'nothing.h5'}"]
