"""summary: what the trace holds, and what the options selected of it."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moetrace.analysis.views import View

SUMMARY_KEYS = (
    "model",
    "architecture",
    "layers",
    "experts",
    "top_k",
    "requests",
    "prompt_tokens",
    "output_tokens",
    "rows",
    "file_size_bytes",
    "complete",
    "dropped_records",
    "finish_reasons",
    "arrays",
)


def _show(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def render(console: Console, r: dict) -> None:
    head = Table(title=r["trace"], show_header=False, box=None)
    for key in SUMMARY_KEYS:
        if key in r:
            head.add_row(key.replace("_", " "), _show(r[key]))
    sel = r["selection"]
    if (
        sel["requests"] != r["requests"]
        or sel["part"] != "all"
        or len(sel["layers"]) != r["layers"]
    ):
        what = f"{sel['requests']:,} requests, {sel['rows']:,} rows"
        if sel["part"] != "all":
            what += f" ({sel['part']} tokens)"
        if len(sel["layers"]) != r["layers"]:
            what += f", layers {', '.join(map(str, sel['layers']))}"
        head.add_row("selected", what)
    if r.get("token_text") and r["token_text"] != "none":
        head.add_row("token text", r["token_text"])
    console.print(head)


# Its entries (the trace's facts, the selection) are in every report.
VIEW = View(
    name="summary",
    help="what the trace holds",
    order=10,
    render=render,
    default=True,
    in_all=True,
)
