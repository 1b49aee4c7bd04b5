"""What the options alone refuse is refused before torch is imported (seconds on a loaded
machine): the installed command's own import log shows torch never loaded."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from support.cli import SCRIPT

from moetrace.cli.early_checks import DEVICES, DTYPES

TORCH = re.compile(r"^import time:.*\|\s+torch$", re.MULTILINE)


def _run(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--top-p", "2"), "error: --top-p: expected a number in (0, 1], got 2.0"),
        (("--device", "gpu"), "error: unknown device 'gpu'; choose auto, cuda or cpu"),
        (("--dtype", "fp8"), "error: unknown dtype 'fp8'"),
        ((), "error: t.h5 already exists (pass --overwrite to replace it or --resume"),
        (("--resume", "--overwrite"), "error: --resume and --overwrite exclude each other"),
    ],
)
def test_record_refuses_before_importing_torch(tmp_path, extra, says):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    (tmp_path / "t.h5").write_bytes(b"keep")
    proc = _run("record", "demo", "p.jsonl", "-o", "t.h5", *extra, cwd=tmp_path)
    assert proc.returncode == 1
    assert says in proc.stderr
    assert not TORCH.search(proc.stderr), "torch was imported before the check"
    assert (tmp_path / "t.h5").read_bytes() == b"keep"


def test_replay_refuses_an_existing_output_before_importing_torch(tmp_path):
    (tmp_path / "r.h5").write_bytes(b"keep")
    proc = _run("replay", "t.h5", "demo", "-o", "r.h5", cwd=tmp_path)
    assert proc.returncode == 1 and "r.h5 already exists" in proc.stderr
    assert not TORCH.search(proc.stderr)


def test_the_early_names_are_the_ones_the_run_takes():
    from moetrace.models.loader import DTYPES as LOADED
    from moetrace.runs.setup import resolve_device

    assert tuple(DTYPES) == ("auto", *LOADED)
    for name in DEVICES:
        if name != "cuda":
            resolve_device(name)
    with pytest.raises(Exception, match="unknown device"):
        resolve_device("gpu")
