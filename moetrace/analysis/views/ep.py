"""ep: what the load means for ranks under expert parallelism (``--ep-size``, ``--ep-map``)."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.ep import EPBalance, expert_map
from moetrace.analysis.views import InspectOptions, View, ViewContext
from moetrace.analysis.views._tables import num, table
from moetrace.errors import MoetraceError


def wanted(opts: InspectOptions) -> bool:
    return bool(opts.ep_size or opts.ep_map)


def check(opts: InspectOptions) -> None:
    if not wanted(opts):
        raise MoetraceError("the ep view needs --ep-size N (or --ep-map FILE)")


def fold(ctx: ViewContext) -> list[EPBalance]:
    opts, trace = ctx.opts, ctx.trace
    ranks = expert_map(
        trace.num_moe_layers, trace.num_experts, opts.ep_size, opts.ep_placement, opts.ep_map
    )
    if ctx.selection.columns is not None:
        ranks = ranks[ctx.selection.columns]
    return [EPBalance(ranks, opts.ep_size)]


def result(ctx: ViewContext, accumulators: list[EPBalance]) -> dict:
    (balance,) = accumulators
    ep = balance.result(ctx.layers)
    ep["placement"] = str(ctx.opts.ep_map) if ctx.opts.ep_map else ctx.opts.ep_placement
    return {"ep": ep}


def render(console: Console, r: dict) -> None:
    ep = r["ep"]
    t = table(f"expert parallelism: load of {ep['ep_size']} ranks, {ep['placement']} placement")
    for name in ("layer", "max/mean", "MaxVio", "busiest", "ranks/tok"):
        t.add_column(name, justify="right", min_width=len(name))
    t.add_column("tokens by ranks (1, 2, ...)", no_wrap=True)
    for p in ep["layers"]:
        hist = p["ranks_per_token_histogram"][1:]
        total = sum(hist) or 1
        t.add_row(
            str(p["layer"]),
            num(p["max_over_mean"]),
            num(p["max_violation"]),
            num(p["busiest_rank"], "d"),
            num(p["mean_ranks_per_token"]),
            " ".join(f"{100 * h / total:.0f}%" for h in hist),
        )
    console.print(t)


VIEW = View(
    name="ep",
    help="what the load means for ranks under expert parallelism",
    order=30,
    render=render,
    fold=fold,
    result=result,
    wanted=wanted,
    check=check,
)
