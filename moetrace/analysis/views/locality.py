"""locality: does a token reuse the previous token's experts."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.locality import Locality
from moetrace.analysis.views import View, ViewContext
from moetrace.analysis.views._tables import num, pct, table


def fold(ctx: ViewContext) -> list[Locality]:
    return [Locality(len(ctx.layers), ctx.trace.num_experts, ctx.trace.top_k)]


def result(ctx: ViewContext, accumulators: list[Locality]) -> dict:
    return {"locality": accumulators[0].result(ctx.layers)}


def render(console: Console, r: dict) -> None:
    t = table("temporal locality: token t against token t-1 of the same request")
    for name in (
        "layer",
        "pairs",
        "top-1 repeat",
        "chance",
        "lift",
        "set repeat",
        "overlap",
        "chance",
        "lift",
    ):
        t.add_column(name, justify="right")
    for p in r["locality"]:
        t.add_row(
            str(p["layer"]),
            f"{p['pairs']:,}",
            pct(p["top1_repeat"]),
            pct(p["top1_chance"]),
            num(p["top1_lift"]),
            pct(p["set_repeat"]),
            pct(p["overlap"]),
            pct(p["overlap_chance"]),
            num(p["overlap_lift"]),
        )
    console.print(t)


VIEW = View(
    name="locality",
    help="does a token reuse the previous token's experts",
    order=40,
    render=render,
    fold=fold,
    result=result,
    in_all=True,
)
