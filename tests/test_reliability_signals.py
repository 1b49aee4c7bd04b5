"""Ctrl-C, SIGTERM and kill -9 on a real ``moetrace record`` process.

Each test waits until the first requests are flushed (polling the file),
sends the signal, then checks that the file opens, says what happened, holds
only intact requests, and (for SIGINT and kill -9) that ``--resume`` turns it
into exactly what an uninterrupted run writes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from reliability_helpers import (
    ENV,
    assert_same_requests,
    popen,
    record_args,
    reference_run,
    run_cli,
)

from moetrace.signals import GracefulStop, Interrupted
from moetrace.trace.verify import verify_trace

N = 600  # far more than a run gets through before the signal: it is always mid-run
SLOW = ("--max-num-seqs", "1", "--flush-every", "4", "--flush-interval", "0.2")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("signals"), N, seed=1, max_tokens=4, max_len=12)


def flushed(path: Path) -> int:
    """Records the running writer has flushed, or -1 while the file cannot be read."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            return int(f.attrs["num_requests"])
    except (OSError, KeyError):
        return -1


def wait_for_flush(proc: subprocess.Popen, path: Path, at_least: int) -> None:
    deadline = time.monotonic() + 60
    while flushed(path) < at_least:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no flush within 60 s"
        time.sleep(0.02)


def start_and_signal(setup, out: Path, sig: int) -> subprocess.CompletedProcess:
    model, prompts, _ = setup
    proc = popen(*record_args(model, prompts, out, "--max-tokens", "4", *SLOW))
    wait_for_flush(proc, out, 8)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_sigint_keeps_finished_work_and_resume_completes_it(tmp_path, setup):
    model, prompts, reference = setup
    out = tmp_path / "t.h5"
    proc = start_and_signal(setup, out, signal.SIGINT)
    assert proc.returncode == 130, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted by SIGINT:") and "--resume" in last, proc.stderr
    assert "Traceback" not in proc.stderr
    report = verify_trace(out)
    assert report.status == "incomplete", report.problems
    assert report.end_reason == "interrupted by SIGINT" and report.dropped == 0
    assert 8 <= report.num_requests < N
    code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "4", "--resume"))
    assert code == 0, err
    assert assert_same_requests(out, reference) == N
    assert verify_trace(out).status == "ok"


def test_sigterm_exits_143_with_a_clean_incomplete_file(tmp_path, setup):
    out = tmp_path / "t.h5"
    proc = start_and_signal(setup, out, signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: interrupted by SIGTERM:")
    report = verify_trace(out)
    assert report.status == "incomplete" and report.end_reason == "interrupted by SIGTERM"


def test_kill_9_leaves_an_intact_prefix_that_resumes(tmp_path, setup):
    model, prompts, reference = setup
    out = tmp_path / "t.h5"
    proc = start_and_signal(setup, out, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    report = verify_trace(out)
    assert report.status == "incomplete", report.problems
    assert report.end_reason == "recording" and report.num_requests >= 8
    code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "4", "--resume"))
    assert code == 0, err
    assert assert_same_requests(out, reference) == N
    assert verify_trace(out).status == "ok"


def test_sigterm_while_waiting_on_stdin(tmp_path, setup):
    """A stalled producer must not keep a stop waiting: the blocking read is left at once."""
    model, _, _ = setup
    out = tmp_path / "t.h5"
    proc = popen(
        *record_args(model, "-", out, "--max-tokens", "4", "--flush-interval", "0.1"),
        stdin=subprocess.PIPE,
    )
    lines = "".join(f'{{"prompt_token_ids": [{i + 1}, 2, 3]}}\n' for i in range(3))
    proc.stdin.write(lines)
    proc.stdin.flush()
    wait_for_flush(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)  # stdin still open: only the signal ends it
    assert proc.returncode == 143, stderr
    report = verify_trace(out)
    assert report.status == "incomplete" and report.num_requests == 3


SECOND_SIGNAL = """
import os, signal, time
from moetrace.signals import GracefulStop
with GracefulStop() as stop:
    stop.arm()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    assert stop.requested
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
print("not reached")
"""


def test_second_signal_exits_at_once():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, env=ENV, timeout=30
    )
    assert proc.returncode == 130, proc.stderr
    assert "not reached" not in proc.stdout and "exiting now" in proc.stderr
    assert time.monotonic() - start < 5


def test_signal_before_recording_starts_raises_at_once():
    with GracefulStop() as stop, pytest.raises(Interrupted) as info:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert stop.signum == signal.SIGTERM
    assert info.value.exit_code == 143 and "before recording started" in str(info.value)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
