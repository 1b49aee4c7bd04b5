"""The installed `moetrace` console script in a subprocess, as a user runs it, and a demo trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "moetrace"


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def moetrace(*args: str, cwd: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"{SCRIPT} missing: install the package (make install)"
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run(
        [str(SCRIPT), *args],
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=120,
        check=False,
        **streams,
    )


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("entry")
    prompts = tmp / "p.jsonl"
    lines = [{"id": f"r{i}", "prompt": "Hello experts " * (i + 1)} for i in range(12)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = moetrace("record", "demo", str(prompts), "-o", str(tmp / "t.h5"), "-q")
    assert proc.returncode == 0, proc.stderr
    return tmp / "t.h5"
