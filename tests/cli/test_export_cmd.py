"""``moetrace export`` as a user runs it: the format a file name asks for, and what it refuses.

What each format holds is checked against plain h5py in tests/analysis/test_export_formats.py;
here the installed command picks the format and refuses a contradiction.
"""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
from support.cli import moetrace, trace  # noqa: F401  (the fixture: a demo trace)


def test_the_extension_picks_the_format(trace, tmp_path):  # noqa: F811
    import pyarrow.parquet as pq

    for name in ("t.parquet", "t.npz", "a.npy", "t.jsonl", "load.json"):
        args = ["-r", "r0"] if name == "a.npy" else []
        proc = moetrace("export", str(trace), "-o", str(tmp_path / name), *args)
        assert proc.returncode == 0, (name, proc.stderr)
    assert pq.read_table(tmp_path / "t.parquet").num_rows == 12
    assert zipfile.is_zipfile(tmp_path / "t.npz")
    assert np.load(tmp_path / "a.npy").ndim == 3
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(f"r{i}" for i in range(12))
    load = json.loads((tmp_path / "load.json").read_text())  # the EPLB document
    assert np.asarray(load["weight"]).shape == (load["num_moe_layers"], load["num_logical_experts"])


def test_a_name_without_a_known_extension_gets_json_lines(trace, tmp_path):  # noqa: F811
    out = tmp_path / "requests.out"
    proc = moetrace("export", str(trace), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert len([json.loads(line) for line in out.read_text().splitlines()]) == 12


@pytest.mark.parametrize(
    ("name", "fmt"), [("t.parquet", "jsonl"), ("t.npz", "parquet"), ("t.jsonl", "npz")]
)
def test_a_format_that_contradicts_the_extension_is_a_usage_error(trace, tmp_path, name, fmt):  # noqa: F811
    out = tmp_path / name
    proc = moetrace("export", str(trace), "-o", str(out), "--format", fmt)
    assert proc.returncode == 2, proc.stderr
    assert "contradicts" in proc.stderr and name in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_a_format_the_extension_allows_is_kept(trace, tmp_path):  # noqa: F811
    out = tmp_path / "load.npy"
    proc = moetrace("export", str(trace), "-o", str(out), "--format", "eplb-npy")
    assert proc.returncode == 0, proc.stderr
    load = np.load(out)
    assert load.ndim == 2 and load.dtype.kind in "iu"  # [layers, experts] counts
