"""Disk full while recording: one line, the flushed requests intact, --resume finishes.

The small disk is a size-limited tmpfs when this process may mount one
(root in a container that allows it), else a file size limit
(RLIMIT_FSIZE, with SIGXFSZ ignored so that writes fail with EFBIG).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.reliability import (
    ENV,
    assert_same_requests,
    record_args,
    reference_run,
    run_cli,
)

from moetrace.trace.diskspace import DEFAULT_RESERVE_BYTES, RESERVE_ENV
from moetrace.trace.verify import verify_trace

N = 300
ROOM = 150_000  # bytes the recording may use: a few dozen requests of the tiny model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("diskfull"), N, seed=2, max_tokens=8, max_len=30)


SmallDisk = tuple[Path, Callable[[], None] | None, str]


@contextlib.contextmanager
def small_disk(tmp_path: Path, reserve: int, room: int = ROOM) -> Iterator[SmallDisk]:
    """(directory, preexec_fn, how): ``reserve + room`` bytes of room for the trace."""
    target = tmp_path / "small"
    target.mkdir()
    size_kib = (reserve + room) // 1024 + 2048
    mounted = (
        os.geteuid() == 0
        and not os.environ.get("MOETRACE_TEST_NO_MOUNT")  # to exercise the fallback
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(target)],
            capture_output=True,
        ).returncode
        == 0
    )
    if mounted:
        stat = os.statvfs(target)
        (target / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - reserve - room))
        try:
            yield target, None, "tmpfs"
        finally:
            subprocess.run(["umount", str(target)], check=False)
        return
    limit = reserve + room

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    yield target, limit_file_size, "RLIMIT_FSIZE"


def _record(setup, target: Path, preexec, env: dict) -> subprocess.CompletedProcess:
    model, prompts, _ = setup
    args = record_args(model, prompts, target / "t.h5", "--max-tokens", "8", "--flush-every", "8")
    return subprocess.run(
        [sys.executable, "-m", "moetrace", *args],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=preexec,
        timeout=120,
    )


def _resume_elsewhere(setup, target: Path, tmp_path: Path) -> None:
    model, prompts, reference = setup
    roomy = tmp_path / "roomy.h5"
    shutil.copy(target / "t.h5", roomy)
    code, _, err = run_cli(*record_args(model, prompts, roomy, "--max-tokens", "8", "--resume"))
    assert code == 0, err
    assert assert_same_requests(roomy, reference) == N
    assert verify_trace(roomy).status == "ok"


def test_disk_full_stops_cleanly_and_resume_finishes(tmp_path, setup):
    with small_disk(tmp_path, DEFAULT_RESERVE_BYTES) as (target, preexec, how):
        proc = _record(setup, target, preexec, ENV)
        assert proc.returncode == 1, (how, proc.stderr)
        err = proc.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("error: disk full while writing") and "--resume" in err, err
        report = verify_trace(target / "t.h5")
        assert report.status == "incomplete", (how, report.problems)
        assert report.end_reason == "disk full" and 0 < report.num_requests < N
        _resume_elsewhere(setup, target, tmp_path)


def test_no_reserve_still_keeps_a_flush_and_stays_resumable(tmp_path, setup):
    """Reserve 0: the writer still keeps the room one flush needs, so HDF5 never meets the
    full disk mid-flush (a file it cannot close); one line, and the file resumes."""
    room = (setup[2].stat().st_size + ROOM) // 2  # the disk fills somewhere mid-run
    with small_disk(tmp_path, 0, room=room) as (target, preexec, how):
        proc = _record(setup, target, preexec, {**ENV, RESERVE_ENV: "0"})
        assert proc.returncode == 1, (how, proc.returncode, proc.stderr)
        err = proc.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("error: disk full while writing"), err
        report = verify_trace(target / "t.h5")
        assert report.status == "incomplete", (how, report.problems)
        assert report.num_requests > 0
        _resume_elsewhere(setup, target, tmp_path)


def test_output_dir_full_before_start(tmp_path, setup, monkeypatch):
    """No room even for the empty trace: refused with one line, nothing left behind."""
    model, prompts, _ = setup
    with small_disk(tmp_path, 0) as (target, preexec, how):
        if how != "tmpfs":
            pytest.skip("needs a small file system to fill")
        (target / "more").write_bytes(b"\0" * max(0, _room(target) - 1024))
        for reserve in (str(DEFAULT_RESERVE_BYTES), "0"):  # our check, then HDF5's own failure
            monkeypatch.setenv(RESERVE_ENV, reserve)
            code, _, err = run_cli(*record_args(model, prompts, target / "t.h5"))
            assert code == 1 and len(err.strip().splitlines()) == 1, err
            assert "t.h5" in err and "Traceback" not in err
            assert not (target / "t.h5").exists()


def _room(target: Path) -> int:
    stat = os.statvfs(target)
    return stat.f_bavail * stat.f_frsize
