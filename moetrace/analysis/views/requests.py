"""requests: per request, its lengths, finish reason and expert reuse (read by offset)."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.requests import request_table
from moetrace.analysis.views import InspectOptions, View, ViewContext
from moetrace.analysis.views._tables import id_table, pct


def wanted(opts: InspectOptions) -> bool:
    return bool(opts.request_ids)


def result(ctx: ViewContext, accumulators: list) -> dict:
    part = ctx.selection.part
    return {"request_table": request_table(ctx.trace, ctx.shown, ctx.selection.columns, part)}


def render(console: Console, r: dict) -> None:
    rows = r["request_table"]
    part = r["selection"]["part"]
    scope = "" if part == "all" else f"; rows and reuse of {part} tokens"
    headers = ("prompt", "output", "rows", "finish", "cached", "preempt", "top-1 rep.",
               "experts used")  # fmt: skip
    columns = [(h, "left" if h == "finish" else "right") for h in headers]
    cells = [
        (
            q["id"],
            [
                f"{q['prompt_len']:,}",
                f"{q['output_len']:,}",
                f"{q['rows']:,}",
                q["finish_reason"],
                f"{q['num_cached_tokens']:,}",
                str(q["num_preemptions"]),
                pct(q["top1_repeat"]),
                pct(q["experts_touched"]),
            ],
        )
        for q in rows
    ]
    title = f"requests ({len(rows):,} shown of {r['selection']['requests']:,}{scope})"
    console.print(id_table(title, console.width, columns, cells))


VIEW = View(
    name="requests",
    help="each request's lengths, finish reason and expert reuse",
    order=80,
    render=render,
    result=result,
    in_all=True,
    wanted=wanted,
)
