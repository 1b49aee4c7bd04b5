"""Ctrl-C, SIGTERM and kill -9 on a real ``moetrace record`` process.

Each test waits until the first requests are flushed (polling the file),
sends the signal, then checks that the file opens, says what happened, holds
only intact requests, and (for SIGINT and kill -9) that ``--resume`` turns it
into exactly what an uninterrupted run writes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from support.reliability import (
    ENV,
    assert_same_requests,
    popen,
    record_args,
    reference_run,
    run_cli,
)

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


INSIDE_TORCH = """
import os, signal, torch
from moetrace.signals import GracefulStop

class Probe:
    # Looked at by torch while it builds a tensor: one signal lands inside that probe.
    sent = False

    def __getattr__(self, name):
        if not Probe.sent:
            Probe.sent = True
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(3):  # bytecodes: the handler runs here, inside torch's probe
                pass
        raise AttributeError(name)

with GracefulStop():  # not armed: weight loading, before the trace exists
    torch.tensor(Probe())
print("not reached")
"""


def test_signal_inside_torch_tensor_construction_is_one_line():
    """torch swallows an exception raised in its attribute probes and raises another one
    (under load: ``could not determine the shape of object type 'torch.storage.UntypedStorage'``
    while loading safetensors): a handler must never raise into the code it interrupts."""
    proc = subprocess.run(
        [sys.executable, "-c", INSIDE_TORCH], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: interrupted by SIGINT before recording started (no trace written)"]
    assert "not reached" not in proc.stdout


def _caught(pid: int) -> int:
    """The process's caught-signal mask (Linux /proc), 0 while it cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(x.split()[1] for x in status.splitlines() if x.startswith("SigCgt:")), 16)


def _torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_signal_at_any_moment_gives_one_line_and_130_or_143(tmp_path):
    """From the first instant (imports, argument checks, weight loading) to the last."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "line {i}"}}\n' for i in range(40)))
    delays = [0.0, 0.1, 0.3, 0.6, 1.0, 1.6, 2.4, 3.2]
    procs = []
    for i, delay in enumerate(delays):
        out = tmp_path / f"t{i}.h5"
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        proc = popen("record", "demo", str(prompts), "-o", str(out), "-q", "--max-tokens", "8")
        deadline = time.monotonic() + 30
        while not _caught(proc.pid) & (1 << (signal.SIGTERM - 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "no SIGTERM handler"
            time.sleep(0.002)
        # Installed before torch loads: the seconds of imports are covered too.
        assert not _torch_loaded(proc.pid)
        procs.append((proc, sig, delay, out))
    start = time.monotonic()
    for proc, sig, delay, _ in sorted(procs, key=lambda p: p[2]):
        time.sleep(max(0.0, start + delay - time.monotonic()))
        proc.send_signal(sig)
    for proc, sig, delay, out in procs:
        _, stderr = proc.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert proc.returncode in (0, 128 + sig), (delay, proc.returncode, stderr)
        if proc.returncode:
            assert "Traceback" not in stderr and len(lines) <= 2, (delay, stderr)
            assert lines[-1].startswith(f"error: interrupted by {signal.Signals(sig).name}"), stderr
        if out.exists():  # stopped while recording: what it holds is intact
            assert verify_trace(out).status in ("ok", "incomplete"), delay
    assert not list(tmp_path.glob(".*creating")), "a half-created trace was left"


def test_a_signal_after_the_trace_is_written_still_gives_one_line_and_143(tmp_path):
    """Interpreter teardown after the summary takes a while; SIGTERM there ended with -15."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for attempt in range(5):
        out = tmp_path / f"t{attempt}.h5"
        proc = popen("record", "demo", str(prompts), "-o", str(out), "-q", "--max-tokens", "2")
        first = proc.stderr.readline()
        assert first.startswith("wrote"), first + proc.communicate()[1]
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
        if proc.returncode == 0:
            continue  # it had already left: try again
        assert proc.returncode == 143, rest
        lines = rest.strip().splitlines()
        assert len(lines) == 1 and "interrupted by SIGTERM after" in lines[0], rest
        assert "complete" in lines[0] and verify_trace(out).status == "ok"
        return
    pytest.fail("the process always left before the signal")


FORKED_CHILD = """
import os, signal, time
from moetrace.signals import install_exit_handlers

install_exit_handlers()
if os.fork() == 0:  # a forked helper (as the CUDA compile workers are) keeps the handlers
    time.sleep(30)
    os._exit(0)
time.sleep(0.3)
os.killpg(0, signal.SIGINT)  # Ctrl-C reaches the whole process group
time.sleep(30)
"""


def test_ctrl_c_to_a_group_with_forked_helpers_prints_one_line():
    proc = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        start_new_session=True,  # its own process group, so killpg spares pytest
    )
    assert proc.returncode == 130
    assert proc.stderr.strip().splitlines() == ["error: interrupted by SIGINT"], proc.stderr
