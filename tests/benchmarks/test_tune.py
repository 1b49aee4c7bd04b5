"""benchmarks/tune.py at tiny shapes in Triton's interpreter: every kernel it tunes runs, each
candidate's output is checked against the default tile's, and a wrong tile never wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
TUNE = ROOT / "benchmarks" / "tune.py"


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("kind", "extra", "cases"),
    [
        ("moe", ["--shapes", "tiny,tiny-mxfp4"], 2),
        ("attention", [], 2),  # with and without sinks
        ("mla", [], 3),  # absorbed decode, absorbed prefill, expanded prefill
    ],
)
def test_each_kernel_is_tuned_on_the_interpreter(kind: str, extra: list[str], cases: int) -> None:
    done = _run([str(TUNE), kind, "--smoke", *extra])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == cases
    for row in rows:
        assert row["kernel"] == kind and row["device"] == "cpu"
        # Both tiles ran and matched the default's output; the winner is one of them.
        assert (row["timed"], row["dropped"]) == (2, 0), row
        assert row["tile"].keys() == row["default"].keys()
        assert row["us"] <= row["default_us"]


def test_unknown_tile_field_is_refused_by_name() -> None:
    done = _run([str(TUNE), "moe", "--smoke", "--tile", "block_x=16"])
    assert done.returncode != 0
    assert "block_x" in done.stderr and "block_m" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_tile_that_computes_something_else_never_wins() -> None:
    """The fastest candidate computes the wrong output: it is dropped, and the correct one
    that is faster than the default wins."""
    script = textwrap.dedent(
        """
        import json, sys, time
        from types import SimpleNamespace
        from typing import NamedTuple
        import torch
        sys.path.insert(0, "benchmarks")
        import tune

        class Tile(NamedTuple):
            variant: str

        def launch(inputs, tile):
            def call():
                time.sleep({"default": 0.05, "right": 0.01, "wrong": 0.0}[tile.variant])
                return inputs.x * (2 if tile.variant == "wrong" else 1)
            return call

        case = tune.Case(
            key={"kernel": "fake"},
            default=Tile("default"),
            grid=[Tile("wrong"), Tile("right")],
            inputs=lambda seed: SimpleNamespace(x=torch.ones(8), nbytes=64),
            launch=launch,
        )
        print(json.dumps(tune.tune(case, 4.29e12)))
        """
    )
    done = _run(["-c", script])
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.splitlines()[-1])
    assert row["tile"] == {"variant": "right"}
    assert (row["timed"], row["dropped"]) == (2, 1)
    assert "relative error" in done.stderr
