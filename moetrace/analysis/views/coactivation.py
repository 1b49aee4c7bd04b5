"""coactivation: which experts of a layer are chosen together for one token."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.coactivation import CoActivation
from moetrace.analysis.views import View, ViewContext
from moetrace.analysis.views._tables import pairs_text, table


def fold(ctx: ViewContext) -> list[CoActivation]:
    return [CoActivation(len(ctx.layers), ctx.trace.num_experts)]


def result(ctx: ViewContext, accumulators: list[CoActivation]) -> dict:
    opts = ctx.opts
    return {"coactivation": accumulators[0].result(ctx.layers, opts.top, opts.rank_by)}


def render(console: Console, r: dict) -> None:
    t = table("co-activation: expert pairs chosen together (count, lift over independence)")
    t.add_column("layer", justify="right")
    t.add_column("top pairs")
    for p in r["coactivation"]:
        t.add_row(str(p["layer"]), pairs_text(p["pairs"], "+"))
    console.print(t)


VIEW = View(
    name="coactivation",
    help="which experts are chosen together",
    order=50,
    render=render,
    fold=fold,
    result=result,
    in_all=True,
)
