"""vocab: which tokens an expert takes (``--expert``), which experts a token goes to (``--token``)."""

from __future__ import annotations

from rich.console import Console

from moetrace.analysis.load import Accumulator
from moetrace.analysis.views import InspectOptions, View, ViewContext
from moetrace.analysis.views._tables import pct, table, token_label
from moetrace.analysis.vocabulary import ExpertVocabulary, TokenExperts
from moetrace.errors import MoetraceError, UsageError


def wanted(opts: InspectOptions) -> bool:
    return bool(opts.experts or opts.tokens or opts.token_texts)


def check(opts: InspectOptions) -> None:
    if not wanted(opts):
        raise MoetraceError("the vocab view needs --expert LAYER:EXPERT or --token ID")


def _parse_expert(text: str, ctx: ViewContext) -> tuple[int, int]:
    try:
        layer_s, expert_s = text.split(":")
        layer, expert = int(layer_s), int(expert_s)
    except ValueError:
        raise MoetraceError(f"--expert {text!r}: expected LAYER:EXPERT, e.g. 3:17") from None
    if layer not in ctx.layers:
        raise MoetraceError(
            f"--expert {text!r}: layer {layer} is not among the analysed layers {ctx.layers}"
        )
    if not 0 <= expert < ctx.trace.num_experts:
        raise MoetraceError(f"--expert {text!r}: expert ids are 0..{ctx.trace.num_experts - 1}")
    return layer, expert


def _token_ids(ctx: ViewContext) -> list[int]:
    ids = []
    for t in ctx.opts.tokens:
        try:
            ids.append(int(t))
        except ValueError:
            raise MoetraceError(
                f"--token {t!r}: expected a token id (use --token-text for text)"
            ) from None
    vocab_size = int(ctx.trace.metadata.get("vocab_size") or 0)
    outside = next((i for i in ids if vocab_size and not 0 <= i < vocab_size), None)
    if outside is not None:
        raise UsageError(
            f"--token {outside}: outside the vocabulary (token ids 0..{vocab_size - 1})"
        )
    for t in ctx.opts.token_texts:
        encoded = ctx.text.encode(t)
        if len(encoded) != 1:
            raise MoetraceError(f"--token-text {t!r} is {len(encoded)} tokens {encoded}, not one")
        ids.append(encoded[0])
    return ids


def fold(ctx: ViewContext) -> list[Accumulator]:
    vocab_size = int(ctx.trace.metadata.get("vocab_size") or 0)
    experts = []
    for spec in ctx.opts.experts:
        layer, expert = _parse_expert(spec, ctx)
        experts.append(ExpertVocabulary(ctx.layers.index(layer), expert, vocab_size))
    num_layers, num_experts = len(ctx.layers), ctx.trace.num_experts
    return [*experts, *(TokenExperts(t, num_layers, num_experts) for t in _token_ids(ctx))]


def result(ctx: ViewContext, accumulators: list[Accumulator]) -> dict:
    top, text = ctx.opts.top, ctx.text
    experts_out, tokens_out = [], []
    for acc in accumulators:
        if isinstance(acc, ExpertVocabulary):
            res = acc.result(ctx.layers[acc.column], top)
            for entry in res["top_tokens"]:
                entry["text"] = text.text(entry["token"])
            experts_out.append(res)
        else:
            res = acc.result(ctx.layers, top)
            res["text"] = text.text(res["token"])
            tokens_out.append(res)
    return {"vocab": {"experts": experts_out, "tokens": tokens_out}}


def render(console: Console, r: dict) -> None:
    for e in r["vocab"]["experts"]:
        t = table(
            f"layer {e['layer']} expert {e['expert']}: {e['tokens_routed']:,} tokens, "
            f"{e['distinct_tokens']:,} distinct"
        )
        for name in ("token", "count", "share of expert", "share of token's uses"):
            t.add_column(name, justify="right")
        for tok in e["top_tokens"]:
            t.add_row(
                token_label(tok["token"], tok.get("text")),
                f"{tok['count']:,}",
                pct(tok["share_of_expert"]),
                pct(tok["share_of_token"]),
            )
        console.print(t)
    for tok in r["vocab"]["tokens"]:
        t = table(
            f"token {token_label(tok['token'], tok.get('text'))}: "
            f"{tok['occurrences']:,} occurrences"
        )
        t.add_column("layer", justify="right")
        t.add_column("usual experts (share of occurrences)")
        for layer in tok["layers"]:
            t.add_row(
                str(layer["layer"]),
                ", ".join(
                    f"{x['expert']} ({pct(x['share_of_token'], 0)})" for x in layer["experts"]
                )
                or "-",
            )
        console.print(t)


VIEW = View(
    name="vocab",
    help="which tokens an expert takes and which experts a token goes to",
    order=70,
    render=render,
    fold=fold,
    result=result,
    wanted=wanted,
    check=check,
)
