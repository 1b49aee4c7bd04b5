"""The installed ``moetrace`` console script, run as a user runs it: in a subprocess.

In-process runners (typer's CliRunner, calling ``main``) skip the entry point
and the exception classes it meets, which is how usage errors once printed
tracebacks on a fresh install.
"""

from __future__ import annotations

import os

import pytest
from support.cli import moetrace, trace  # noqa: F401  (the fixture: a demo trace)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "Usage: moetrace"),
        (("frobnicate",), "No such command 'frobnicate'"),
        (("inspect", "--bogus", "t.h5"), "No such option: --bogus"),
        (("record",), "Usage: moetrace record"),
        (("record", "demo"), "Missing argument 'PROMPTS'"),
        (("export", "t.h5", "--dtype"), "Option '--dtype' requires an argument"),
    ],
)
def test_usage_errors_exit_2_with_clicks_message(args, message):
    proc = moetrace(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    both = proc.stdout + proc.stderr
    assert message in both
    assert "Traceback" not in both


def test_user_error_is_one_line_exit_1(tmp_path):
    proc = moetrace("inspect", str(tmp_path / "missing.h5"))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: no such trace file: {tmp_path / 'missing.h5'}"]


def test_version_and_help_exit_0():
    assert moetrace("--version").stdout.strip().startswith("moetrace ")
    proc = moetrace("inspect", "--help")
    assert proc.returncode == 0 and "TRACE" in proc.stdout


def test_help_keeps_the_shapes_it_names():
    """Help is rich markup: an unescaped ``[name]`` in a docstring is eaten as a tag."""
    proc = moetrace("export", "--help")
    text = " ".join(proc.stdout.split())  # the help is wrapped to the terminal's width
    assert proc.returncode == 0
    assert "[num_moe_layers, num_experts]" in text
    assert "[windows, layers, experts]" in text


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{t}"),
        ("inspect", "{t}", "--all"),
        ("inspect", "{t}", "--json"),
        ("diff", "{t}", "{t}"),
        ("export", "{t}"),
    ],
)
def test_closed_standard_output_exits_0_quietly(trace, args):  # noqa: F811
    """``moetrace inspect t.h5 | head -1``: the reader closing early is no failure."""
    read, write = os.pipe()
    os.close(read)  # every write meets a closed pipe, whatever the timing
    try:
        proc = moetrace(*(a.format(t=trace) for a in args), stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
