"""--resume: a stopped trace is finished into what one uninterrupted run writes.

Settings that change rows must match (else a one-line refusal and the file
is untouched); batching and cache settings may differ.  The writer's append
mode is checked on its own: any split point gives the same datasets, table
and table checksum as writing everything at once.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reliability import (
    assert_one_line_error,
    assert_same_requests,
    record_args,
    reference_run,
    run_cli,
    tiny_checkpoint,
    token_prompts,
    write_jsonl,
)
from support.traces import make_metadata, mixed_requests

from moetrace.config import EngineConfig
from moetrace.errors import MoetraceError
from moetrace.runs.recording import Recording, SamplingDefaults
from moetrace.runs.setup import RunOptions
from moetrace.signals import GracefulStop, Interrupted
from moetrace.trace.records import REQUESTS, ROUTED_EXPERTS, TOKEN_IDS
from moetrace.trace.verify import verify_trace
from moetrace.trace.writer import TraceWriter

N = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint, its prompts and one uninterrupted reference trace."""
    return reference_run(tmp_path_factory.mktemp("resume"), N, seed=5, max_tokens=6)


class StopAfter(GracefulStop):
    """A stop request that 'arrives' once ``n`` requests have finished (no real signal)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def progress(self, result, total) -> None:
        if result.requests >= self.n and self.signum is None:
            self.signum = signal.SIGINT


def interrupted_run(model: Path, prompts: Path, out: Path, after: int) -> None:
    recording = Recording(
        RunOptions.of(
            str(model),
            engine=EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=4),
            load_format="dummy",
        ),
        str(prompts),
        out,
        sampling=SamplingDefaults(max_tokens=6),
        flush_every_requests=3,
    )
    stop = StopAfter(after)
    with pytest.raises(Interrupted) as info:
        recording.run(progress=stop.progress, stop=stop)
    assert info.value.exit_code == 130 and "--resume" in str(info.value)


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, setup):
    model, prompts, reference = setup
    out = tmp_path / "t.h5"
    interrupted_run(model, prompts, out, after=7)
    report = verify_trace(out)
    assert report.status == "incomplete" and report.end_reason == "interrupted by SIGINT"
    assert 7 <= report.num_requests < N and report.expected_requests == N
    # Batching and cache settings differ from both earlier runs: rows are invariant to them.
    code, _, err = run_cli(
        *record_args(model, prompts, out, "--max-tokens", "6", "--resume"),
        "--max-num-seqs",
        "5",
        "--block-size",
        "8",
        "--no-enable-prefix-caching",
    )
    assert code == 0, err
    assert f"after {report.num_requests} kept" in err
    assert assert_same_requests(out, reference) == N
    final = verify_trace(out)
    assert final.status == "ok", final.problems
    with h5py.File(out, "r") as f:
        resumes = json.loads(f.attrs["resumes"])
        assert [r["kept_requests"] for r in resumes] == [report.num_requests]
        assert f.attrs["end_reason"] == "complete"


def test_resume_cuts_off_what_a_kill_left_behind(tmp_path, setup):
    model, prompts, reference = setup
    out = tmp_path / "t.h5"
    interrupted_run(model, prompts, out, after=5)
    kept = verify_trace(out).num_requests
    with h5py.File(out, "r+") as f:  # orphan rows and tokens, then a record not backed by data
        for name, extra in ((ROUTED_EXPERTS, 37), (TOKEN_IDS, 11)):
            ds = f[name]
            ds.resize(ds.shape[0] + extra, axis=0)
        table = f[REQUESTS]
        ghost = table[kept - 1]
        ghost["id"] = b"ghost"
        ghost["row_start"] += ghost["num_rows"]
        ghost["token_start"] += ghost["prompt_len"] + ghost["output_len"]
        table.resize(kept + 1, axis=0)
        table[kept] = ghost
    before = verify_trace(out)
    assert before.status == "incomplete" and before.dropped == 1
    code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "6", "--resume"))
    assert code == 0, err
    assert assert_same_requests(out, reference) == N
    assert verify_trace(out).status == "ok"


def test_resume_of_a_complete_trace_changes_nothing(tmp_path, setup):
    model, prompts, reference = setup
    out = tmp_path / "t.h5"
    out.write_bytes(reference.read_bytes())
    code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "6", "--resume"))
    assert code == 0, err
    assert f"0 requests (after {N} kept" in err
    assert assert_same_requests(out, reference) == N
    assert verify_trace(out).status == "ok"


def test_resume_without_a_file_starts_one(tmp_path, setup):
    model, prompts, reference = setup
    out = tmp_path / "new.h5"
    code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "6", "--resume"))
    assert code == 0, err
    assert assert_same_requests(out, reference) == N


@pytest.mark.parametrize(
    "extra, needles",
    [
        (("--max-tokens", "7"), ("--max-tokens 6 (this run: 7)",)),
        (("--max-tokens", "6", "--seed", "3"), ("--seed 0 (this run: 3)",)),
        (("--max-tokens", "6", "--temperature", "0.5"), ("--temperature",)),
        (("--max-tokens", "6", "--dtype", "float64"), ("--dtype float32 (this run: float64)",)),
        (("--max-tokens", "6", "--max-model-len", "100"), ("--max-model-len",)),
        (("--max-tokens", "6", "--ignore-eos"), ("--ignore-eos",)),
    ],
)
def test_resume_refuses_other_settings(tmp_path, setup, extra, needles):
    model, prompts, reference = setup
    out = tmp_path / "t.h5"
    out.write_bytes(reference.read_bytes())
    code, _, err = run_cli(*record_args(model, prompts, out, *extra, "--resume"))
    assert_one_line_error(code, err, "cannot resume", *needles)
    assert out.read_bytes() == reference.read_bytes()


def test_resume_refuses_another_model(tmp_path, setup):
    _, prompts, reference = setup
    other = tiny_checkpoint(tmp_path / "other", num_experts=16)
    out = tmp_path / "t.h5"
    out.write_bytes(reference.read_bytes())
    code, _, err = run_cli(*record_args(other, prompts, out, "--max-tokens", "6", "--resume"))
    assert_one_line_error(code, err, "cannot resume", "model config")
    assert out.read_bytes() == reference.read_bytes()


def test_resume_refuses_other_prompts(tmp_path, setup):
    model, prompts, reference = setup
    lines = token_prompts(N, seed=5)
    out = tmp_path / "t.h5"
    out.write_bytes(reference.read_bytes())
    changed = [dict(x) for x in lines]
    changed[3]["prompt_token_ids"] = [1, 2, 3]
    path = write_jsonl(tmp_path / "changed.jsonl", changed)
    code, _, err = run_cli(*record_args(model, path, out, "--max-tokens", "6", "--resume"))
    assert_one_line_error(code, err, "cannot resume", "'q3'", "another prompt")
    path = write_jsonl(tmp_path / "fewer.jsonl", lines[:-1])
    code, _, err = run_cli(*record_args(model, path, out, "--max-tokens", "6", "--resume"))
    assert_one_line_error(code, err, "cannot resume", f"'q{N - 1}'", "does not")
    assert out.read_bytes() == reference.read_bytes()


def test_resume_refuses_what_is_not_a_trace(tmp_path, setup):
    model, prompts, _ = setup
    out = tmp_path / "t.h5"
    out.write_bytes(b"not hdf5 at all")
    code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "6", "--resume"))
    assert_one_line_error(code, err, "not an HDF5 file")
    assert out.read_bytes() == b"not hdf5 at all"


# --------------------------------------------------------------------------- writer append
def _datasets(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        table = f[REQUESTS][:]
        return {
            "rows": f[ROUTED_EXPERTS][:],
            "tokens": f[TOKEN_IDS][:],
            "table": table,
            "crc": int(f.attrs["requests_crc32"]),
            "complete": bool(f.attrs["complete"]),
        }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    split=st.integers(0, 30),
    chunk=st.sampled_from([1, 7, 64]),
    orphans=st.integers(0, 70),
    flush_every=st.integers(1, 9),
)
def test_append_at_any_point_equals_writing_at_once(
    tmp_path_factory, split, chunk, orphans, flush_every
):
    tmp = tmp_path_factory.mktemp("append")
    md = make_metadata()
    reqs = mixed_requests(md, n=30, seed=split)
    kw = {"chunk_rows": chunk, "flush_every_requests": flush_every}
    with TraceWriter(tmp / "once.h5", md, **kw) as w:
        for r in reqs:
            w.submit(r)
    w = TraceWriter(tmp / "twice.h5", md, **kw).start()
    for r in reqs[:split]:
        w.submit(r)
    w.close(complete=False)
    if orphans:  # what a kill between data and records leaves
        with h5py.File(tmp / "twice.h5", "r+") as f:
            ds = f[ROUTED_EXPERTS]
            ds.resize(ds.shape[0] + orphans, axis=0)
            ds[-orphans:] = 3
    w = TraceWriter(tmp / "twice.h5", md, append=True, **kw).start()
    assert w.kept_requests == split
    for r in reqs[split:]:
        w.submit(r)
    w.close()
    once, twice = _datasets(tmp / "once.h5"), _datasets(tmp / "twice.h5")
    np.testing.assert_array_equal(twice["rows"], once["rows"])
    np.testing.assert_array_equal(twice["tokens"], once["tokens"])
    assert twice["table"].tolist() == once["table"].tolist()
    assert twice["crc"] == once["crc"] and twice["complete"]
    assert verify_trace(tmp / "twice.h5").status == "ok"


def test_append_refuses_another_layout(tmp_path):
    md = make_metadata()
    with TraceWriter(tmp_path / "t.h5", md) as w:
        w.submit(mixed_requests(md, n=1)[0])
    with pytest.raises(
        MoetraceError, match="cannot append.*routed_experts entries are uint8 \\[3, 4\\]"
    ):
        TraceWriter(tmp_path / "t.h5", make_metadata(layers=2), append=True).start()
    with pytest.raises(MoetraceError, match="no trace file"):
        TraceWriter(tmp_path / "none.h5", md, append=True).start()
