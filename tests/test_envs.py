"""The environment table: every variable moetrace reads is in it, documented, and parsed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moetrace import envs
from moetrace.errors import MoetraceError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bMOETRACE_[A-Z0-9_]+\b")


def test_every_moetrace_variable_named_in_the_package_is_in_the_table():
    named = {
        name
        for path in (ROOT / "moetrace").rglob("*.py")
        for name in NAME.findall(path.read_text())
    }
    assert named <= set(envs.ENVIRONMENT), named - set(envs.ENVIRONMENT)


def test_only_the_table_reads_the_environment_for_moetraces_own_settings():
    readers = []
    for path in (ROOT / "moetrace").rglob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if ("os.environ" in line or "getenv" in line) and NAME.search(line):
                readers.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert readers == []


def test_the_docs_table_lists_each_variable_with_its_default():
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        match = re.match(r"\| `(MOETRACE_\w+)` \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    assert set(rows) == set(envs.ENVIRONMENT)
    for name, var in envs.ENVIRONMENT.items():
        assert rows[name] == _shown(var.default), name


def _shown(default) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(int(default))
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def test_unset_or_empty_gives_the_default(monkeypatch):
    for name, var in envs.ENVIRONMENT.items():
        monkeypatch.delenv(name, raising=False)
        assert envs.get(name) == var.default
        monkeypatch.setenv(name, "  ")
        assert envs.get(name) == var.default


def test_values_are_parsed(monkeypatch):
    monkeypatch.setenv("MOETRACE_DISK_RESERVE_BYTES", "0")
    assert envs.get("MOETRACE_DISK_RESERVE_BYTES") == 0
    monkeypatch.setenv("MOETRACE_DIST_TIMEOUT", "2.5")
    assert envs.get("MOETRACE_DIST_TIMEOUT") == 2.5
    monkeypatch.setenv("MOETRACE_SERVE_TIMELINE", "/tmp/t.json")
    assert envs.get("MOETRACE_SERVE_TIMELINE") == Path("/tmp/t.json")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MOETRACE_DISK_RESERVE_BYTES", "-1"),
        ("MOETRACE_DISK_RESERVE_BYTES", "8M"),
        ("MOETRACE_DIST_TIMEOUT", "0"),
        ("MOETRACE_DIST_TIMEOUT", "nan"),
        ("MOETRACE_SERVE_SWITCH_INTERVAL_MS", "fast"),
        ("MOETRACE_SINK_DECODE_PACK", "3"),
        ("MOETRACE_SINK_RECIPROCAL", "yes"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable_and_the_value(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(MoetraceError) as info:
        envs.get(name)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{name} must be ") and repr(value) in message
