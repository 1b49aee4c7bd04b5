"""load: how evenly each layer spreads its tokens over its experts."""

from __future__ import annotations

import numpy as np
from rich.console import Console

from moetrace.analysis.balance import LoadCounter, layer_load, prompt_vs_output, shares
from moetrace.analysis.views import View, ViewContext
from moetrace.analysis.views._tables import num, table


def fold(ctx: ViewContext) -> list[LoadCounter]:
    return [LoadCounter(len(ctx.layers), ctx.trace.num_experts)]


def result(ctx: ViewContext, accumulators: list[LoadCounter]) -> dict:
    (load,) = accumulators
    out = {
        "layer_load": layer_load(load.counts, ctx.layers),
        "expert_counts": load.counts.tolist(),
        # None for a layer without assignments in the selection (its shares are undefined).
        "expert_shares": [
            None if np.isnan(row).any() else np.round(row, 6).tolist()
            for row in shares(load.counts)
        ],
    }
    if ctx.opts.part == "all":
        out["prompt_vs_output"] = prompt_vs_output(load.prompt, load.output, ctx.layers)
    return out


def render(console: Console, r: dict) -> None:
    part = r["selection"]["part"]
    per = r["layer_load"]
    title = "expert load per MoE layer"
    if per and per[0]["mean"] is not None:
        title += f" ({per[0]['assignments']:,} assignments, {per[0]['mean']:,.1f} per expert"
        title += ")" if part == "all" else f", {part} tokens)"
    elif per:
        title += " (nothing selected)"
    t = table(title)
    cols = ("layer", "min", "max", "max/mean", "MaxVio", "CV", "Gini", "entropy")
    for name in (*cols, "dead"):
        t.add_column(name, justify="right", min_width=min(len(name), 8))
    for row in per:
        t.add_row(
            str(row["layer"]),
            num(row["min"], ","),
            num(row["max"], ","),
            num(row["max_over_mean"]),
            num(row["max_violation"]),
            num(row["cv"]),
            num(row["gini"], ".3f"),
            num(row["normalized_entropy"], ".3f"),
            num(row["dead_experts"], "d"),
        )
    console.print(t)
    pvo = r.get("prompt_vs_output")
    if (
        pvo
        and any(p["prompt_assignments"] for p in pvo)
        and any(p["output_assignments"] for p in pvo)
    ):
        t = table("prompt vs output tokens")
        for name in ("layer", "prompt MaxVio", "output MaxVio", "load distance (TV)"):
            t.add_column(name, justify="right")
        for p in pvo:
            t.add_row(
                str(p["layer"]),
                num(p["prompt_max_violation"]),
                num(p["output_max_violation"]),
                num(p["total_variation"], ".3f"),
            )
        console.print(t)


VIEW = View(
    name="load",
    help="how evenly each layer spreads its tokens over experts",
    order=20,
    render=render,
    fold=fold,
    result=result,
    default=True,
    in_all=True,
)
