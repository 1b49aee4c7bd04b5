"""requests: per request, its lengths, finish reason and expert reuse (read by offset)."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.requests import request_table
from moetrace.analysis.views import InspectOptions, View, ViewContext
from moetrace.analysis.views._tables import pct, table


def wanted(opts: InspectOptions) -> bool:
    return bool(opts.request_ids)


def result(ctx: ViewContext, accumulators: list) -> dict:
    part = ctx.selection.part
    return {"request_table": request_table(ctx.trace, ctx.shown, ctx.selection.columns, part)}


def render(console: Console, r: dict) -> None:
    rows = r["request_table"]
    part = r["selection"]["part"]
    scope = "" if part == "all" else f"; rows and reuse of {part} tokens"
    t = table(f"requests ({len(rows):,} shown of {r['selection']['requests']:,}{scope})")
    for name in ("id", "prompt", "output", "rows", "finish", "cached", "preempt"):
        t.add_column(name, justify="right" if name not in ("id", "finish") else "left")
    t.add_column("top-1 rep.", justify="right")
    t.add_column("experts used", justify="right")
    for q in rows:
        t.add_row(
            q["id"],
            f"{q['prompt_len']:,}",
            f"{q['output_len']:,}",
            f"{q['rows']:,}",
            q["finish_reason"],
            f"{q['num_cached_tokens']:,}",
            str(q["num_preemptions"]),
            pct(q["top1_repeat"]),
            pct(q["experts_touched"]),
        )
    console.print(t)


VIEW = View(
    name="requests",
    help="each request's lengths, finish reason and expert reuse",
    order=80,
    render=render,
    result=result,
    in_all=True,
    wanted=wanted,
)
