"""What ``moetrace inspect`` reports: the chosen views over the chosen rows, in one pass.

Views that fold rows (load, ep, locality, coactivation, transitions, vocab)
share a single streamed pass; the per-request views read their requests by
offset.  The result is plain JSON-able data; the CLI only renders it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moetrace.analysis.balance import LoadCounter, layer_load, prompt_vs_output, shares
from moetrace.analysis.coactivation import CoActivation, Transitions
from moetrace.analysis.ep import EPBalance, expert_map
from moetrace.analysis.load import (
    DEFAULT_CHUNK_ROWS,
    RowStream,
    Selection,
    layer_indices,
    run,
    select_columns,
    select_positions,
)
from moetrace.analysis.locality import Locality
from moetrace.analysis.requests import request_table, token_view
from moetrace.analysis.tokens import TokenText, token_text
from moetrace.analysis.vocabulary import ExpertVocabulary, TokenExperts
from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace
from moetrace.trace.stats import summary

VIEWS = (
    "summary",
    "load",
    "ep",
    "locality",
    "coactivation",
    "transitions",
    "vocab",
    "requests",
    "tokens",
)
DEFAULT_VIEWS = ("summary", "load")
ALL_VIEWS = ("summary", "load", "locality", "coactivation", "transitions", "requests")


@dataclass
class InspectOptions:
    views: list[str] = field(default_factory=list)  # empty: the defaults plus what options imply
    all_views: bool = False
    request_ids: list[str] = field(default_factory=list)
    ranges: list[str] = field(default_factory=list)
    part: str = "all"
    layers: list[int] = field(default_factory=list)
    ep_size: int | None = None
    ep_placement: str = "contiguous"
    ep_map: Path | None = None
    experts: list[str] = field(default_factory=list)  # "LAYER:EXPERT"
    tokens: list[str] = field(default_factory=list)  # ids, or text with --token-text
    token_texts: list[str] = field(default_factory=list)
    top: int = 10
    rank_by: str = "count"
    limit: int = 50
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    tokenizer: str | None = None


def chosen_views(opts: InspectOptions) -> list[str]:
    """The views asked for, plus those an option implies (``--ep-size`` -> ep, ...)."""
    unknown = [v for v in opts.views if v not in VIEWS]
    if unknown:
        raise MoetraceError(f"unknown view {unknown[0]!r}; views: {', '.join(VIEWS)}")
    views = list(opts.views) or list(DEFAULT_VIEWS)
    if opts.all_views:
        views += ALL_VIEWS
    if opts.ep_size or opts.ep_map:
        views.append("ep")
    if opts.experts or opts.tokens or opts.token_texts:
        views.append("vocab")
    if opts.request_ids:
        views += ["requests", "tokens"]
    if opts.rank_by not in ("count", "lift"):
        raise MoetraceError(f"--rank-by must be count or lift, got {opts.rank_by!r}")
    if opts.top < 1:
        raise MoetraceError(f"--top must be at least 1, got {opts.top}")
    if "ep" in views and not (opts.ep_size or opts.ep_map):
        raise MoetraceError("the ep view needs --ep-size N (or --ep-map FILE)")
    if "vocab" in views and not (opts.experts or opts.tokens or opts.token_texts):
        raise MoetraceError("the vocab view needs --expert LAYER:EXPERT or --token ID")
    return [v for v in VIEWS if v in views]


def _parse_expert(text: str, trace: Trace, layers: list[int]) -> tuple[int, int]:
    try:
        layer_s, expert_s = text.split(":")
        layer, expert = int(layer_s), int(expert_s)
    except ValueError:
        raise MoetraceError(f"--expert {text!r}: expected LAYER:EXPERT, e.g. 3:17") from None
    if layer not in layers:
        raise MoetraceError(
            f"--expert {text!r}: layer {layer} is not among the analysed layers {layers}"
        )
    if not 0 <= expert < trace.num_experts:
        raise MoetraceError(f"--expert {text!r}: expert ids are 0..{trace.num_experts - 1}")
    return layer, expert


def _token_ids(opts: InspectOptions, text: TokenText) -> list[int]:
    ids = []
    for t in opts.tokens:
        try:
            ids.append(int(t))
        except ValueError:
            raise MoetraceError(
                f"--token {t!r}: expected a token id (use --token-text for text)"
            ) from None
    for t in opts.token_texts:
        encoded = text.encode(t)
        if len(encoded) != 1:
            raise MoetraceError(f"--token-text {t!r} is {len(encoded)} tokens {encoded}, not one")
        ids.append(encoded[0])
    return ids


def inspect_report(trace: Trace, opts: InspectOptions) -> dict:
    """Every chosen view of ``trace`` as one JSON-able dict."""
    views = chosen_views(opts)
    positions = select_positions(trace, opts.request_ids, opts.ranges)
    selection = Selection(positions, opts.part, select_columns(trace, opts.layers))
    layers = layer_indices(trace, selection)
    num_layers, num_experts, k = len(layers), trace.num_experts, trace.top_k
    stream = RowStream(trace, selection, opts.chunk_rows)
    text = token_text(trace, opts.tokenizer)
    ids = trace.request_ids
    report: dict = {"trace": str(trace.path), **summary(trace)}
    report["selection"] = {
        **stream.counts(),
        "part": opts.part,
        "layers": layers,
        "request_ids": None if positions is None else [ids[p] for p in positions[:20]],
    }
    report["token_text"] = text.source

    accs: dict[str, object] = {}
    if "load" in views:
        accs["load"] = LoadCounter(num_layers, num_experts)
    if "ep" in views:
        ranks = expert_map(
            trace.num_moe_layers, num_experts, opts.ep_size, opts.ep_placement, opts.ep_map
        )
        if selection.columns is not None:
            ranks = ranks[selection.columns]
        accs["ep"] = EPBalance(ranks, opts.ep_size)
    if "locality" in views:
        accs["locality"] = Locality(num_layers, num_experts, k)
    if "coactivation" in views:
        accs["coactivation"] = CoActivation(num_layers, num_experts)
    if "transitions" in views:
        accs["transitions"] = Transitions(num_layers, num_experts)
    vocab_experts, vocab_tokens = [], []
    if "vocab" in views:
        for spec in opts.experts:
            layer, expert = _parse_expert(spec, trace, layers)
            acc = ExpertVocabulary(
                layers.index(layer), expert, int(trace.metadata.get("vocab_size") or 0)
            )
            vocab_experts.append((layer, acc))
        vocab_tokens = [TokenExperts(t, num_layers, num_experts) for t in _token_ids(opts, text)]
    folding = list(accs.values()) + [a for _, a in vocab_experts] + vocab_tokens
    if folding:
        run(stream, folding)

    if "load" in views:
        load: LoadCounter = accs["load"]
        report["layer_load"] = layer_load(load.counts, layers)
        report["expert_counts"] = load.counts.tolist()
        report["expert_shares"] = np.round(np.nan_to_num(shares(load.counts)), 6).tolist()
        if opts.part == "all":
            report["prompt_vs_output"] = prompt_vs_output(load.prompt, load.output, layers)
    if "ep" in views:
        report["ep"] = accs["ep"].result(layers)
        report["ep"]["placement"] = str(opts.ep_map) if opts.ep_map else opts.ep_placement
    if "locality" in views:
        report["locality"] = accs["locality"].result(layers)
    if "coactivation" in views:
        report["coactivation"] = accs["coactivation"].result(layers, opts.top, opts.rank_by)
    if "transitions" in views:
        report["transitions"] = accs["transitions"].result(layers, opts.top, opts.rank_by)
    if "vocab" in views:
        experts_out = []
        for layer, acc in vocab_experts:
            res = acc.result(layer, opts.top)
            for entry in res["top_tokens"]:
                entry["text"] = text.text(entry["token"])
            experts_out.append(res)
        tokens_out = []
        for acc in vocab_tokens:
            res = acc.result(layers, opts.top)
            res["text"] = text.text(res["token"])
            tokens_out.append(res)
        report["vocab"] = {"experts": experts_out, "tokens": tokens_out}
    shown = positions if positions is not None else np.arange(trace.num_requests)
    if opts.limit:
        shown = shown[: opts.limit]
    if "requests" in views:
        report["request_table"] = request_table(trace, shown, selection.columns)
    if "tokens" in views:
        report["token_table"] = [
            token_view(trace, int(p), text, selection.columns, opts.part) for p in shown
        ]
    report["views"] = views
    return report
