"""What ``moetrace inspect`` reports: the chosen views over the chosen rows, in one pass.

Each view is declared in its own module of ``analysis/views/``.  Views that
fold rows share a single streamed pass; the per-request views read their
requests by offset.  The result is plain JSON-able data; the views' renderers
draw it.
"""

from __future__ import annotations

import numpy as np

from moetrace.analysis.load import (
    RowStream,
    Selection,
    layer_indices,
    run,
    select_columns,
    select_positions,
)
from moetrace.analysis.tokens import token_text
from moetrace.analysis.views import InspectOptions, View, ViewContext, registry
from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace
from moetrace.trace.stats import summary

__all__ = ["InspectOptions", "chosen_views", "inspect_report"]


def chosen_views(opts: InspectOptions) -> list[View]:
    """The views asked for, plus those an option implies (``--ep-size`` -> ep, ...), in order."""
    views = registry()
    names = [v.name for v in views]
    unknown = [v for v in opts.views if v not in names]
    if unknown:
        raise MoetraceError(f"unknown view {unknown[0]!r}; views: {', '.join(names)}")
    asked = set(opts.views) or {v.name for v in views if v.default}
    if opts.all_views:
        asked |= {v.name for v in views if v.in_all}
    asked |= {v.name for v in views if v.wanted(opts)}
    if opts.rank_by not in ("count", "lift"):
        raise MoetraceError(f"--rank-by must be count or lift, got {opts.rank_by!r}")
    if opts.top < 1:
        raise MoetraceError(f"--top must be at least 1, got {opts.top}")
    chosen = [v for v in views if v.name in asked]
    for view in chosen:
        view.check(opts)
    return chosen


def inspect_report(trace: Trace, opts: InspectOptions) -> dict:
    """Every chosen view of ``trace`` as one JSON-able dict."""
    views = chosen_views(opts)
    positions = select_positions(trace, opts.request_ids, opts.ranges)
    selection = Selection(positions, opts.part, select_columns(trace, opts.layers))
    layers = layer_indices(trace, selection)
    stream = RowStream(trace, selection, opts.chunk_rows)
    text = token_text(trace, opts.tokenizer)
    ids = trace.request_ids
    report: dict = {"trace": str(trace.path), **summary(trace)}
    report["selection"] = {
        **stream.counts(),
        "part": opts.part,
        "layers": layers,
        "request_ids": None if positions is None else [ids[p] for p in positions[:20]],
    }
    report["token_text"] = text.source

    shown = positions if positions is not None else np.arange(trace.num_requests)
    if opts.limit:
        shown = shown[: opts.limit]
    ctx = ViewContext(trace, opts, selection, layers, text, shown)
    folds = {view.name: view.fold(ctx) for view in views}
    accumulators = [acc for accs in folds.values() for acc in accs]
    if accumulators:
        run(stream, accumulators)
    for view in views:
        report.update(view.result(ctx, folds[view.name]))
    report["views"] = [view.name for view in views]
    return report
