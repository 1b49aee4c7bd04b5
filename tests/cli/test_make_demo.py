"""``make demo`` installs what the demo needs, and the demo needs nothing more."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What `pip install -e .` does not bring: the test, serve, parquet and plot extras.
NOT_INSTALLED_BY_DEMO = (
    "pytest", "hypothesis", "transformers", "ruff", "matplotlib", "importlinter", "pyarrow",
    "pandas", "datasets", "starlette", "uvicorn", "openai", "httpx",
)  # fmt: skip

# Runs the CLI as if the extras were not installed: the import system finds nothing by
# their names (importlib.util.find_spec says None, as it does for an absent package).
WITHOUT_EXTRAS = """
import sys, importlib.abc
class Hiding(importlib.abc.MetaPathFinder):
    def __init__(self, finders):
        self.finders = finders
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None
sys.meta_path[:] = [Hiding(list(sys.meta_path))]
sys.argv = ["moetrace", *sys.argv[1:]]
from moetrace.cli.entry import main
main()
"""


def test_make_demo_installs_moetrace_without_its_extras(tmp_path):
    plan = subprocess.run(
        ["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert any(line.endswith("pip install -q -e .") for line in installs), installs
    assert not any("[test]" in line or "[" in line.split("pip install")[1] for line in installs)


def test_the_demo_runs_without_the_extras(tmp_path):
    script = WITHOUT_EXTRAS.format(blocked=set(NOT_INSTALLED_BY_DEMO))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hello! Tell me about experts."}\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in (["record", "demo", str(prompts), "-o", str(tmp_path / "t.h5")],
                 ["inspect", str(tmp_path / "t.h5")]):  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                              text=True, env=env, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr


def test_a_missing_extra_is_named_with_what_installs_it_from_the_clone(tmp_path):
    """moetrace is not on a package index: 'pip install moetrace[parquet]' finds nothing."""
    script = WITHOUT_EXTRAS.format(blocked={"pyarrow"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hi", "max_tokens": 2}\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in (["record", "demo", str(prompts), "-o", str(tmp_path / "t.h5"), "-q"],
                 ["export", str(tmp_path / "t.h5"), "-o", str(tmp_path / "t.parquet")]):  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                              text=True, env=env, check=False)  # fmt: skip
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert "make extra EXTRA=parquet" in line and "pip install -e '.[parquet]'" in line
    assert "'moetrace[" not in line
    plan = subprocess.run(
        ["make", "-n", "extra", "EXTRA=parquet", f"VENV={tmp_path / 'venv'}"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert any(line.endswith('pip install -q -e ".[parquet]"') for line in plan.splitlines())
