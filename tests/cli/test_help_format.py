"""``--help`` in a pipe and at narrow widths: every option's name whole, flags as flags.

At 80 columns the rich table cut 18 names in ``record --help`` and 22 in
``serve --help`` (``--enable-return-routed-experts`` as ``--enable-return…``)
and showed ``--json <bool>``, ``SHARD... <list[Path]>``.  The names expected
here are read from the commands' own declarations, not written out.
"""

from __future__ import annotations

import functools
import os
import subprocess

import pytest
import typer
from support.cli import SCRIPT

from moetrace.cli.app import app

COMMANDS = typer.main.get_command(app).commands


@functools.lru_cache
def _help(command: str, columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.run([str(SCRIPT), command, "--help"], capture_output=True, text=True,
                          env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    ("command", "columns"),
    [*((c, 80) for c in sorted(COMMANDS)), ("record", 50), ("serve", 50)],
)
def test_every_option_name_is_whole(command, columns):
    text = _help(command, columns)
    words = set(text.replace(",", " ").split())
    for param in COMMANDS[command].params:
        if getattr(param, "hidden", False):
            continue
        for name in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
            if isinstance(param, typer.core.TyperOption):
                assert name in words, (command, name)
    assert "…" not in text and "<bool>" not in text and "<list[" not in text


def test_flags_show_as_flags_and_values_as_click_names_them():
    lines = {line.split()[0]: line for line in _help("inspect", 80).splitlines() if line.strip()}
    assert lines["--json"].split()[1] == "Print"  # no value after a flag
    assert "--limit INTEGER" in lines["--limit"]
    assert "--plot PATH" in lines["--plot"]
    merge = _help("merge", 80)
    assert "  SHARD...  Shard traces" in merge and "Usage: moetrace merge [OPTIONS] {OUT}" in merge
    serve = _help("serve", 80)
    assert "--enable-return-routed-experts" in serve and "--enable-return-routed-weights" in serve


def test_examples_keep_their_lines():
    text = _help("diff", 80)
    assert "  Example: moetrace diff bf16.h5 fp32.h5\n" in text
