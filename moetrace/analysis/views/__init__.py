"""``moetrace inspect``'s views, one module each: a new view is one new module here.

Each module declares ``VIEW = View(...)``: its name and help line, when it is
shown, the accumulators it folds over the selected rows (all views share one
streamed pass), the report entries it makes of them, and the rich renderer of
those entries.  ``registry()`` finds every module's ``VIEW``, in ``order``;
``analysis/report.py`` runs the chosen ones and the CLI renders their entries.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
from rich.console import Console

from moetrace.analysis.load import DEFAULT_CHUNK_ROWS, Accumulator, Selection
from moetrace.analysis.tokens import TokenText
from moetrace.trace.reader import Trace


@dataclass
class InspectOptions:
    views: list[str] = field(default_factory=list)  # empty: the defaults plus what options imply
    all_views: bool = False
    request_ids: list[str] = field(default_factory=list)
    ranges: list[str] = field(default_factory=list)
    part: str = "all"
    layers: list[int] = field(default_factory=list)
    ep_size: int | None = None
    ep_placement: str = "contiguous"
    ep_map: Path | None = None
    redundant_experts: int = 0  # replicas placed by balanced packing (ep view)
    experts: list[str] = field(default_factory=list)  # "LAYER:EXPERT"
    tokens: list[str] = field(default_factory=list)  # ids, or text with --token-text
    token_texts: list[str] = field(default_factory=list)
    top: int = 10
    rank_by: str = "count"
    limit: int = 50
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    tokenizer: str | None = None


@dataclass
class ViewContext:
    """What every view may use: the trace, the options and what they selected."""

    trace: Trace
    opts: InspectOptions
    selection: Selection
    layers: list[int]  # decoder indices of the selected MoE layers (the rows' columns)
    text: TokenText
    shown: np.ndarray  # record numbers of the requests the per-request views list


def _no_accumulators(ctx: ViewContext) -> list[Accumulator]:
    return []


def _no_entries(ctx: ViewContext, accumulators: list[Accumulator]) -> dict:
    return {}


def _never(opts: InspectOptions) -> bool:
    return False


def _runs_with_anything(opts: InspectOptions) -> None:
    return None


@dataclass(frozen=True)
class View:
    """One view of ``moetrace inspect``; see the package docstring."""

    name: str
    help: str  # one line: what the view answers
    order: int  # its place in the report and among the tables
    render: Callable[[Console, dict], None]  # draws the entries ``result`` made
    fold: Callable[[ViewContext], list[Accumulator]] = _no_accumulators
    result: Callable[[ViewContext, list[Accumulator]], dict] = _no_entries
    default: bool = False  # shown when no view is asked for
    in_all: bool = False  # added by --all
    wanted: Callable[[InspectOptions], bool] = _never  # options that turn it on
    check: Callable[[InspectOptions], None] = _runs_with_anything  # MoetraceError if unusable


@cache
def registry() -> tuple[View, ...]:
    """Every view declared in this package, in ``order``."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            found.append(importlib.import_module(f"{__name__}.{module.name}").VIEW)
    return tuple(sorted(found, key=lambda v: v.order))


def view_named(name: str) -> View:
    return next(v for v in registry() if v.name == name)


def render_report(console: Console, report: dict) -> None:
    """The tables of every view in ``report``, in the order it ran them."""
    for name in report["views"]:
        view_named(name).render(console, report)
