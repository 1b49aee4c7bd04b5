"""What a command says about a damaged trace: it advises only what that command can do.

``inspect`` and ``export`` can read past a failed checksum (``--no-verify-checksums``)
and say so; ``diff``, ``merge`` and ``replay`` have no such option and said it anyway.
"""

from __future__ import annotations

import shutil

import h5py
from support.cli import moetrace, trace  # noqa: F401  (the fixture: a demo trace)


def _damaged_copy(source, tmp_path):
    path = tmp_path / "damaged.h5"
    shutil.copy(source, path)
    with h5py.File(path, "r+") as f:
        rec = f["requests"][3]
        f["routed_experts"][int(rec["row_start"]) + 1, 0, 0] ^= 1  # one id of request 3 changed
    return path


def test_each_command_advises_what_it_can_do(trace, tmp_path):  # noqa: F811
    damaged = _damaged_copy(trace, tmp_path)
    said = {
        "inspect": moetrace("inspect", str(damaged)),
        "export": moetrace("export", str(damaged)),
        "diff": moetrace("diff", str(trace), str(damaged)),
        "merge": moetrace("merge", str(tmp_path / "m.h5"), str(damaged)),
    }
    for command, proc in said.items():
        assert proc.returncode in (1, 2), (command, proc.stderr)
        line = proc.stderr.strip().splitlines()[-1]
        assert "request 3" in line and "checksum mismatch" in line, (command, line)
        assert "'moetrace verify' lists every problem" in line, command
        assert ("--no-verify-checksums" in line) == (command in ("inspect", "export")), command
        assert "open_trace" not in line, command  # Python's way, not a command's
    assert not (tmp_path / "m.h5").exists()
    proc = moetrace("inspect", str(damaged), "--no-verify-checksums")
    assert proc.returncode == 0, proc.stderr  # what the advice says works
