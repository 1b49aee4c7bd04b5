"""tokens: per token of the chosen requests, its text and the experts of each layer."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.requests import token_view
from moetrace.analysis.views import InspectOptions, View, ViewContext
from moetrace.analysis.views._tables import table

MAX_TOKEN_COLUMNS = 8  # layers shown side by side


def wanted(opts: InspectOptions) -> bool:
    return bool(opts.request_ids)


def result(ctx: ViewContext, accumulators: list) -> dict:
    columns, part = ctx.selection.columns, ctx.opts.part
    return {
        "token_table": [token_view(ctx.trace, int(p), ctx.text, columns, part) for p in ctx.shown]
    }


def _shown_columns(n: int) -> list[int]:
    if n <= MAX_TOKEN_COLUMNS:
        return list(range(n))
    step = (n - 1) / (MAX_TOKEN_COLUMNS - 1)
    return sorted({round(i * step) for i in range(MAX_TOKEN_COLUMNS)})


def _visible(text: str | None) -> str:
    """Token text as shown: control characters arrive escaped; quoted if spaces would hide."""
    if text is None:
        return ""
    return f"'{text}'" if not text or text.strip() != text else text


def render(console: Console, r: dict) -> None:
    layers = r["selection"]["layers"]
    cols = _shown_columns(len(layers))
    for req in r["token_table"]:
        title = (
            f"request {req['id']!r}: {req['prompt_len']} prompt + {req['output_len']} output "
            f"tokens ({req['finish_reason']}); top-k experts in router order"
        )
        if len(cols) < len(layers):
            title += f"; layers {', '.join(str(layers[c]) for c in cols)} of {len(layers)} (--layer picks)"
        t = table(title)
        for name in ("pos", "part", "token", "text"):
            t.add_column(name, justify="right" if name in ("pos", "token") else "left")
        for c in cols:
            t.add_column(f"L{layers[c]}", justify="left")
        for tok in req["tokens"]:
            experts = tok["experts"]
            cells = (
                [" ".join(map(str, experts[c])) for c in cols]
                if experts is not None
                else ["(not run)"] + [""] * (len(cols) - 1)
            )
            t.add_row(
                str(tok["position"]),
                tok["part"],
                str(tok["token"]),
                _visible(tok["text"]),
                *cells,
            )
        console.print(t)


VIEW = View(
    name="tokens",
    help="each token's text and its experts in every layer",
    order=90,
    render=render,
    result=result,
    wanted=wanted,
)
