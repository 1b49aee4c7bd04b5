"""A user's files are never destroyed: an output is never an input, never a non-file, and
never written by two runs at once; a reader of a trace being written says so.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from support.reliability import (
    assert_one_line_error,
    popen,
    record_args,
    run_cli,
    run_proc,
    tiny_checkpoint,
    token_prompts,
    write_jsonl,
)

from moetrace.trace.lock import lock_path, writer_pid
from moetrace.trace.verify import verify_trace


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def prompts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", token_prompts(4, seed=3))


def _refused_and_intact(code: int, err: str, path: Path, before: bytes, *needles: str) -> None:
    assert_one_line_error(code, err, *needles)
    assert path.read_bytes() == before, "the input was changed"


# ------------------------------------------------------------------ output is an input
def test_output_is_the_prompt_file(tmp_path, model, prompts):
    before = prompts.read_bytes()
    code, _, err = run_cli(*record_args(model, prompts, prompts, "--overwrite"))
    _refused_and_intact(code, err, prompts, before, "is the prompt file")


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_output_is_a_link_to_the_prompt_file(tmp_path, model, prompts, link):
    before = prompts.read_bytes()
    alias = tmp_path / "alias.h5"
    (os.link if link == "hard" else os.symlink)(prompts, alias)
    code, _, err = run_cli(*record_args(model, prompts, alias, "--overwrite"))
    _refused_and_intact(code, err, prompts, before, "is the prompt file", "under another name")


def test_output_is_the_file_standard_input_reads(tmp_path, model, prompts):
    before = prompts.read_bytes()
    with prompts.open("rb") as stdin:
        proc = run_proc(*record_args(model, "-", prompts, "--overwrite"), stdin=stdin)
    _refused_and_intact(proc.returncode, proc.stderr, prompts, before, "is the prompt file")


def test_output_is_a_file_of_the_model(tmp_path, model, prompts):
    config = model / "config.json"
    before = config.read_bytes()
    code, _, err = run_cli(*record_args(model, prompts, config, "--overwrite"))
    _refused_and_intact(code, err, config, before, "a file of the model (config.json)")


def test_export_merge_and_import_never_write_over_what_they_read(tmp_path, model, prompts):
    trace = tmp_path / "t.h5"
    assert run_cli(*record_args(model, prompts, trace))[0] == 0
    before = trace.read_bytes()
    code, _, err = run_cli("export", str(trace), "-o", str(trace), "--overwrite")
    _refused_and_intact(code, err, trace, before, "the trace being exported")
    os.link(trace, tmp_path / "same.h5")
    code, _, err = run_cli("merge", str(tmp_path / "same.h5"), str(trace), "--overwrite")
    _refused_and_intact(code, err, trace, before, "shard", "under another name")
    responses = tmp_path / "r.jsonl"
    responses.write_text("{}\n")
    code, _, err = run_cli("import", str(responses), "-o", str(responses), "--overwrite")
    _refused_and_intact(code, err, responses, b"{}\n", "the response file")


# ------------------------------------------------------------------ not a regular file
def _special_files(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    sock = tmp_path / "sock.h5"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    found = {"a FIFO": fifo, "a socket": sock}
    null = tmp_path / "null.h5"
    try:  # a character device like /dev/null (root only)
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        found["a character device"] = null
    except PermissionError:
        pass
    return found


def test_overwrite_never_replaces_a_device_fifo_or_socket(tmp_path, model, prompts):
    for kind, path in _special_files(tmp_path).items():
        mode = os.stat(path).st_mode
        for extra in (("--overwrite",), ("--resume",)):
            code, _, err = run_cli(*record_args(model, prompts, path, *extra))
            assert_one_line_error(code, err, f"it is {kind}, not a regular file")
            assert os.stat(path).st_mode == mode, f"{kind} was replaced"


# ------------------------------------------------------------------ one writer at a time
def _slow_run(model: Path, tmp_path: Path, out: Path) -> subprocess.Popen:
    # Far more than the test needs: it is still running when the test ends it.
    slow = write_jsonl(tmp_path / "slow.jsonl", token_prompts(20_000, seed=4, max_len=12))
    args = ("--max-tokens", "8", "--max-num-seqs", "1", "--flush-every", "2")
    proc = popen(*record_args(model, slow, out, *args, "--flush-interval", "0.05"))
    deadline = time.monotonic() + 60
    while writer_pid(out) is None or not out.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def test_a_second_run_on_the_same_output_is_refused(tmp_path, model, prompts):
    out = tmp_path / "t.h5"
    first = _slow_run(model, tmp_path, out)
    try:
        for extra in (("--overwrite",), ("--resume",)):
            code, _, err = run_cli(*record_args(model, prompts, out, *extra))
            assert first.poll() is None, "the first run ended early: the test proves nothing"
            assert_one_line_error(code, err, "is being written by another moetrace run", "pid")
        # Readers: what is flushed so far, and that it is still being written.
        report = verify_trace(out)
        assert report.status == "incomplete" and report.being_written == first.pid
        assert "being written" in report.summary()
        code, _, err = run_cli("inspect", str(out))
        assert code == 0 and "is being written by a running moetrace" in err, err
    finally:
        first.terminate()
        first.communicate(timeout=60)
    assert not lock_path(out).exists(), "the lock file is removed when the run ends"
    assert verify_trace(out).being_written is None


def test_a_stale_lock_file_does_not_block(tmp_path, model, prompts):
    """What a run killed with -9 leaves: the file, but no lock on it."""
    out = tmp_path / "t.h5"
    lock_path(out).write_text("12345\n")
    code, _, err = run_cli(*record_args(model, prompts, out))
    assert code == 0, err
    assert verify_trace(out).status == "ok" and not lock_path(out).exists()


def test_resume_of_a_finished_file_is_not_blocked_by_its_own_lock(tmp_path, model, prompts):
    out = tmp_path / "t.h5"
    assert run_cli(*record_args(model, prompts, out))[0] == 0
    code, _, err = run_cli(*record_args(model, prompts, out, "--resume"))
    assert code == 0, err
    assert json.loads(str(verify_trace(out).to_dict()["requests"])) == 4
