"""Rich tables for ``moetrace inspect``: one renderer per view of ``inspect_report``'s result."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

MAX_TOKEN_COLUMNS = 8  # layers shown side by side in the per-token table


def _table(title: str) -> Table:
    """Tables without vertical rules: ten numeric columns still fit 80 characters."""
    return Table(title=title, box=box.SIMPLE_HEAVY)


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _show(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


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
)


def render_summary(console: Console, r: dict) -> None:
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


def render_load(console: Console, r: dict) -> None:
    part = r["selection"]["part"]
    per = r["layer_load"]
    title = "expert load per MoE layer"
    if per:
        title += f" ({per[0]['assignments']:,} assignments, {per[0]['mean']:,.1f} per expert"
        title += ")" if part == "all" else f", {part} tokens)"
    table = _table(title)
    cols = ("layer", "min", "max", "max/mean", "MaxVio", "CV", "Gini", "entropy")
    for name in (*cols, "dead"):
        table.add_column(name, justify="right", min_width=min(len(name), 8))
    for row in per:
        table.add_row(
            str(row["layer"]),
            f"{row['min']:,}",
            f"{row['max']:,}",
            _f(row["max_over_mean"]),
            _f(row["max_violation"]),
            _f(row["cv"]),
            _f(row["gini"], ".3f"),
            _f(row["normalized_entropy"], ".3f"),
            str(row["dead_experts"]),
        )
    console.print(table)
    pvo = r.get("prompt_vs_output")
    if (
        pvo
        and any(p["prompt_assignments"] for p in pvo)
        and any(p["output_assignments"] for p in pvo)
    ):
        t = _table("prompt vs output tokens")
        for name in ("layer", "prompt MaxVio", "output MaxVio", "load distance (TV)"):
            t.add_column(name, justify="right")
        for p in pvo:
            t.add_row(
                str(p["layer"]),
                _f(p["prompt_max_violation"]),
                _f(p["output_max_violation"]),
                _f(p["total_variation"], ".3f"),
            )
        console.print(t)


def render_ep(console: Console, r: dict) -> None:
    ep = r["ep"]
    table = _table(
        f"expert parallelism: load of {ep['ep_size']} ranks, {ep['placement']} placement"
    )
    for name in ("layer", "max/mean", "MaxVio", "busiest", "ranks/tok"):
        table.add_column(name, justify="right", min_width=len(name))
    table.add_column("tokens by ranks (1, 2, ...)", no_wrap=True)
    for p in ep["layers"]:
        hist = p["ranks_per_token_histogram"][1:]
        total = sum(hist) or 1
        table.add_row(
            str(p["layer"]),
            _f(p["max_over_mean"]),
            _f(p["max_violation"]),
            str(p["busiest_rank"]),
            _f(p["mean_ranks_per_token"]),
            " ".join(f"{100 * h / total:.0f}%" for h in hist),
        )
    console.print(table)


def render_locality(console: Console, r: dict) -> None:
    table = _table("temporal locality: token t against token t-1 of the same request")
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
        table.add_column(name, justify="right")
    for p in r["locality"]:
        table.add_row(
            str(p["layer"]),
            f"{p['pairs']:,}",
            _pct(p["top1_repeat"]),
            _pct(p["top1_chance"]),
            _f(p["top1_lift"]),
            _pct(p["set_repeat"]),
            _pct(p["overlap"]),
            _pct(p["overlap_chance"]),
            _f(p["overlap_lift"]),
        )
    console.print(table)


def _pairs_text(pairs: list[dict], arrow: str) -> str:
    return (
        ", ".join(f"{p['a']}{arrow}{p['b']} ({p['count']:,}, x{p['lift']:.1f})" for p in pairs)
        or "-"
    )


def render_coactivation(console: Console, r: dict) -> None:
    table = _table("co-activation: expert pairs chosen together (count, lift over independence)")
    table.add_column("layer", justify="right")
    table.add_column("top pairs")
    for p in r["coactivation"]:
        table.add_row(str(p["layer"]), _pairs_text(p["pairs"], "+"))
    console.print(table)


def render_transitions(console: Console, r: dict) -> None:
    table = _table("layer transitions: expert at layer l -> expert at layer l+1, same token")
    for name in ("layers", "top-1 predictable", "chance"):
        table.add_column(name, justify="right")
    table.add_column("top pairs (count, lift)")
    for p in r["transitions"]:
        table.add_row(
            f"{p['from_layer']}->{p['to_layer']}",
            _pct(p["top1_predictability"]),
            _pct(p["top1_chance"]),
            _pairs_text(p["pairs"], "->"),
        )
    console.print(table)


def _visible(text: str | None) -> str:
    """Token text as shown: control characters arrive escaped; quoted if spaces would hide."""
    if text is None:
        return ""
    return f"'{text}'" if not text or text.strip() != text else text


def _token_label(token: int, text: str | None) -> str:
    return f"{token}" if text is None else f"{token} '{text}'"


def render_vocab(console: Console, r: dict) -> None:
    for e in r["vocab"]["experts"]:
        table = _table(
            f"layer {e['layer']} expert {e['expert']}: {e['tokens_routed']:,} tokens, "
            f"{e['distinct_tokens']:,} distinct"
        )
        for name in ("token", "count", "share of expert", "share of token's uses"):
            table.add_column(name, justify="right")
        for t in e["top_tokens"]:
            table.add_row(
                _token_label(t["token"], t.get("text")),
                f"{t['count']:,}",
                _pct(t["share_of_expert"]),
                _pct(t["share_of_token"]),
            )
        console.print(table)
    for tok in r["vocab"]["tokens"]:
        table = _table(
            f"token {_token_label(tok['token'], tok.get('text'))}: "
            f"{tok['occurrences']:,} occurrences"
        )
        table.add_column("layer", justify="right")
        table.add_column("usual experts (share of occurrences)")
        for layer in tok["layers"]:
            table.add_row(
                str(layer["layer"]),
                ", ".join(
                    f"{x['expert']} ({_pct(x['share_of_token'], 0)})" for x in layer["experts"]
                )
                or "-",
            )
        console.print(table)


def render_requests(console: Console, r: dict) -> None:
    rows = r["request_table"]
    table = _table(f"requests ({len(rows):,} shown of {r['selection']['requests']:,})")
    for name in ("id", "prompt", "output", "rows", "finish", "cached", "preempt"):
        table.add_column(name, justify="right" if name not in ("id", "finish") else "left")
    table.add_column("top-1 rep.", justify="right")
    table.add_column("experts used", justify="right")
    for q in rows:
        table.add_row(
            q["id"],
            f"{q['prompt_len']:,}",
            f"{q['output_len']:,}",
            f"{q['rows']:,}",
            q["finish_reason"],
            f"{q['num_cached_tokens']:,}",
            str(q["num_preemptions"]),
            _pct(q["top1_repeat"]),
            _pct(q["experts_touched"]),
        )
    console.print(table)


def _shown_columns(n: int) -> list[int]:
    if n <= MAX_TOKEN_COLUMNS:
        return list(range(n))
    step = (n - 1) / (MAX_TOKEN_COLUMNS - 1)
    return sorted({round(i * step) for i in range(MAX_TOKEN_COLUMNS)})


def render_tokens(console: Console, r: dict) -> None:
    layers = r["selection"]["layers"]
    cols = _shown_columns(len(layers))
    for req in r["token_table"]:
        title = (
            f"request {req['id']!r}: {req['prompt_len']} prompt + {req['output_len']} output "
            f"tokens ({req['finish_reason']}); top-k experts in router order"
        )
        if len(cols) < len(layers):
            title += f"; layers {', '.join(str(layers[c]) for c in cols)} of {len(layers)} (--layer picks)"
        table = _table(title)
        for name in ("pos", "part", "token", "text"):
            table.add_column(name, justify="right" if name in ("pos", "token") else "left")
        for c in cols:
            table.add_column(f"L{layers[c]}", justify="left")
        for t in req["tokens"]:
            experts = t["experts"]
            cells = (
                [" ".join(map(str, experts[c])) for c in cols]
                if experts is not None
                else ["(not run)"] + [""] * (len(cols) - 1)
            )
            table.add_row(
                str(t["position"]),
                t["part"],
                str(t["token"]),
                _visible(t["text"]),
                *cells,
            )
        console.print(table)


RENDERERS = {
    "summary": render_summary,
    "load": render_load,
    "ep": render_ep,
    "locality": render_locality,
    "coactivation": render_coactivation,
    "transitions": render_transitions,
    "vocab": render_vocab,
    "requests": render_requests,
    "tokens": render_tokens,
}


def render_report(console: Console, report: dict) -> None:
    for view in report["views"]:
        RENDERERS[view](console, report)
