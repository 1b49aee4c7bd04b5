"""A trace on a read-only file system: readers read it, writers refuse in one line.

Not attacked before this round (issue 18, "Not yet attacked").  Readers
(``verify``, ``inspect``, ``export``) worked, also on an interrupted trace
with the stale lock file its killed run left; ``record -o`` into the
directory and ``--resume`` of a trace there said "permission denied", which
sends a user to ``chmod``: now "read-only file system".  The file system is a
tmpfs remounted read-only (root only: as root, permission bits refuse
nothing, so a ``chmod`` would test nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import h5py
import pytest
from support.reliability import (
    assert_one_line_error,
    popen,
    record_args,
    reference_run,
    run_cli,
    token_prompts,
    write_jsonl,
)

from moetrace.trace.lock import lock_path
from moetrace.trace.verify import verify_trace

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readonly")
    model, prompts, complete = reference_run(tmp, 12, seed=3, max_tokens=4)
    killed = tmp / "killed.h5"  # an interrupted run: incomplete, with its lock file left behind
    many = write_jsonl(tmp / "many.jsonl", token_prompts(5000, seed=5))
    proc = popen(*record_args(model, many, killed, "--flush-every", "2", "--max-num-seqs", "1"))
    try:
        deadline = time.monotonic() + 300
        while _flushed(killed) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert lock_path(killed).exists()
    return model, prompts, complete, killed


def _flushed(path: Path) -> int:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return int(f.attrs["num_requests"])
    except (OSError, KeyError):
        return 0


@pytest.fixture
def read_only(tmp_path, setup):
    """A directory holding both traces, the prompts and the stale lock, mounted read-only."""
    _, prompts, complete, killed = setup
    target = tmp_path / "ro"
    target.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(target)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        for source in (prompts, complete, killed, lock_path(killed)):
            shutil.copy(source, target / source.name)
        subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
        with pytest.raises(OSError):
            (target / "probe").write_bytes(b"")
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_readers_read_a_trace_on_a_read_only_file_system(read_only, tmp_path):
    for name, status, code in (("reference.h5", "ok", 0), ("killed.h5", "incomplete", 3)):
        trace = read_only / name
        report = verify_trace(trace)
        assert report.status == status and report.being_written is None, report.summary()
        assert run_cli("verify", str(trace))[0] == code
        got, out, err = run_cli("verify", str(trace), "--json")
        assert got == code and json.loads(out)["status"] == status, err
        got, _, err = run_cli("inspect", str(trace), "--all")
        assert got == 0 and "Traceback" not in err, err
        got, out, err = run_cli("export", str(trace))
        assert got == 0 and len(out.splitlines()) == report.num_requests, err
        exported = tmp_path / f"{name}.jsonl"
        got, _, err = run_cli("export", str(trace), "-o", str(exported))
        assert got == 0 and exported.stat().st_size > 0, err


def test_writers_refuse_a_read_only_file_system_in_one_line(read_only, setup):
    model = setup[0]
    prompts = read_only / "p.jsonl"
    before = {p.name: p.read_bytes() for p in read_only.iterdir()}
    for out, extra in (
        (read_only / "new.h5", ()),
        (read_only / "killed.h5", ("--resume",)),
        (read_only / "reference.h5", ("--overwrite",)),
    ):
        code, _, err = run_cli(*record_args(model, prompts, out, *extra))
        assert_one_line_error(code, err, f"cannot write {out}: read-only file system")
    code, _, err = run_cli("export", str(read_only / "reference.h5"), "-o", str(read_only / "x"))
    assert_one_line_error(code, err, "read-only file system")
    assert {p.name: p.read_bytes() for p in read_only.iterdir()} == before
