"""Inspect's views are a registry: each is one module, and a new module is a new view."""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import typer
from rich.console import Console
from support.analysis import metadata, planted_requests, write_trace

from moetrace import open_trace
from moetrace.analysis import views
from moetrace.analysis.report import InspectOptions, inspect_report
from moetrace.analysis.views import registry, render_report
from moetrace.cli.app import app
from moetrace.errors import MoetraceError

REPO = Path(__file__).resolve().parents[2]


def test_each_module_declares_the_view_it_is_named_after():
    modules = sorted(
        p.stem for p in Path(views.__file__).parent.glob("*.py") if not p.stem.startswith("_")
    )
    assert sorted(v.name for v in registry()) == modules
    orders = [v.order for v in registry()]
    assert orders == sorted(set(orders))


def test_help_and_docs_name_every_view():
    inspect = typer.main.get_command(app).commands["inspect"]
    view_help = next(p.help for p in inspect.params if p.name == "view")
    documented = (REPO / "docs" / "analysis.md").read_text()
    for view in registry():
        assert f"{view.name}: {view.help}" in view_help
        assert f"| `{view.name}` |" in documented


# A view written the way docs/contributing.md says: one module, nothing else touched.
NEW_VIEW = '''
"""rowcount: rows of each selected layer whose first choice is an even expert."""

import numpy as np

from moetrace.analysis.views import View


class EvenFirst:
    def __init__(self, num_layers):
        self.counts = np.zeros(num_layers, dtype=np.int64)

    def update(self, block):
        self.counts += (block.rows[:, :, 0] % 2 == 0).sum(axis=0)

    def result(self):
        return self.counts.tolist()


def fold(ctx):
    return [EvenFirst(len(ctx.layers))]


def result(ctx, accumulators):
    return {"even_first": accumulators[0].result()}


def render(console, r):
    console.print("even first choices: " + " ".join(map(str, r["even_first"])))


VIEW = View(name="rowcount", help="rows whose first choice is even", order=95,
            render=render, fold=fold, result=result)
'''


@pytest.fixture
def one_more_view(tmp_path, monkeypatch):
    (tmp_path / "rowcount.py").write_text(textwrap.dedent(NEW_VIEW))
    monkeypatch.setattr(views, "__path__", [*views.__path__, str(tmp_path)])
    registry.cache_clear()
    yield
    registry.cache_clear()
    sys.modules.pop("moetrace.analysis.views.rowcount", None)


def test_a_new_module_is_a_new_view(tmp_path, one_more_view):
    reqs = planted_requests()
    path = write_trace(tmp_path / "t.h5", reqs, metadata())
    with open_trace(path) as trace:
        report = inspect_report(trace, InspectOptions(views=["summary", "rowcount"]))
    rows = np.concatenate([r.routed_experts for r in reqs])
    assert report["even_first"] == (rows[:, :, 0] % 2 == 0).sum(axis=0).tolist()
    assert report["views"] == ["summary", "rowcount"]
    out = io.StringIO()
    render_report(Console(file=out, width=200), report)
    assert "even first choices: " + " ".join(map(str, report["even_first"])) in out.getvalue()
    with pytest.raises(MoetraceError, match="views: .*tokens, rowcount"), open_trace(path) as t:
        inspect_report(t, InspectOptions(views=["nosuch"]))
