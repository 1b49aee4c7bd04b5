"""ep: what the load means for ranks under expert parallelism (``--ep-size``, ``--ep-map``).

With ``--redundant-experts R`` it adds what replicating experts would do: R
extra replicas placed by balanced packing (``analysis/eplb.py``), the rank
loads after beside those of the placement given.
"""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.balance import LoadCounter
from moetrace.analysis.ep import EPBalance, expert_map
from moetrace.analysis.eplb import check_replication, replicated_report
from moetrace.analysis.views import InspectOptions, View, ViewContext
from moetrace.analysis.views._tables import num, table
from moetrace.errors import MoetraceError


def wanted(opts: InspectOptions) -> bool:
    return bool(opts.ep_size or opts.ep_map or opts.redundant_experts)


def check(opts: InspectOptions) -> None:
    if not (opts.ep_size or opts.ep_map):
        what = "--redundant-experts" if opts.redundant_experts else "the ep view"
        raise MoetraceError(f"{what} needs --ep-size N (or --ep-map FILE)")


def fold(ctx: ViewContext) -> list[EPBalance | LoadCounter]:
    opts, trace = ctx.opts, ctx.trace
    ranks = expert_map(
        trace.num_moe_layers, trace.num_experts, opts.ep_size, opts.ep_placement, opts.ep_map
    )
    if ctx.selection.columns is not None:
        ranks = ranks[ctx.selection.columns]
    balance = EPBalance(ranks, opts.ep_size)
    if not opts.redundant_experts:
        return [balance]
    check_replication(trace.num_experts, balance.ep_size, opts.redundant_experts)
    return [balance, LoadCounter(len(ctx.layers), trace.num_experts)]


def result(ctx: ViewContext, accumulators: list[EPBalance | LoadCounter]) -> dict:
    balance = accumulators[0]
    ep = balance.result(ctx.layers)
    ep["placement"] = str(ctx.opts.ep_map) if ctx.opts.ep_map else ctx.opts.ep_placement
    if len(accumulators) > 1:
        counts = accumulators[1].counts
        ep["replicated"] = replicated_report(
            counts, balance.rank_load, balance.ep_size, ctx.opts.redundant_experts, ctx.layers
        )
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
    rep = ep.get("replicated")
    if rep:
        _render_replicated(console, ep, rep)


def _render_replicated(console: Console, ep: dict, rep: dict) -> None:
    t = table(
        f"{rep['redundant_experts']} redundant experts by balanced packing: "
        f"{rep['physical_experts']} slots, {rep['slots_per_rank']} a rank"
    )
    for name in ("layer", "max/mean before", "after", "MaxVio before", "after"):
        t.add_column(name, justify="right", min_width=len(name))
    t.add_column("expert x copies", no_wrap=True)
    for p in rep["layers"]:
        copies = sorted(p["replicated"].items(), key=lambda kv: (-kv[1], kv[0]))
        t.add_row(
            str(p["layer"]),
            num(p["max_over_mean_before"]),
            num(p["max_over_mean"]),
            num(p["max_violation_before"]),
            num(p["max_violation"]),
            " ".join(f"{e}x{n}" for e, n in copies[:8]) + (" ..." if len(copies) > 8 else ""),
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
