"""transitions: which expert at layer l leads to which at layer l+1, for the same token."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.coactivation import Transitions
from moetrace.analysis.views import View, ViewContext
from moetrace.analysis.views._tables import pairs_text, pct, table


def fold(ctx: ViewContext) -> list[Transitions]:
    return [Transitions(len(ctx.layers), ctx.trace.num_experts)]


def result(ctx: ViewContext, accumulators: list[Transitions]) -> dict:
    opts = ctx.opts
    return {"transitions": accumulators[0].result(ctx.layers, opts.top, opts.rank_by)}


def render(console: Console, r: dict) -> None:
    t = table("layer transitions: expert at layer l -> expert at layer l+1, same token")
    for name in ("layers", "top-1 predictable", "chance"):
        t.add_column(name, justify="right")
    t.add_column("top pairs (count, lift)")
    for p in r["transitions"]:
        t.add_row(
            f"{p['from_layer']}->{p['to_layer']}",
            pct(p["top1_predictability"]),
            pct(p["top1_chance"]),
            pairs_text(p["pairs"], "->"),
        )
    console.print(t)


VIEW = View(
    name="transitions",
    help="which expert at layer l leads to which at l+1",
    order=60,
    render=render,
    fold=fold,
    result=result,
    in_all=True,
)
