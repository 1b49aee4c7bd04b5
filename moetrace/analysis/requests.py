"""Per-request and per-token views, each request read on its own from the table's offsets."""

from __future__ import annotations

import numpy as np

from moetrace.analysis.tokens import TokenText
from moetrace.trace.reader import Trace, TraceRequest


def _routing(req: TraceRequest, columns: np.ndarray | None, part: str = "all") -> np.ndarray:
    """The request's rows of the selected layers, all of them or those of one part.

    Row t is token t's routing, so the prompt's rows come first.
    """
    rows = req.routed_experts
    if part == "prompt":
        rows = rows[: req.prompt_len]
    elif part == "output":
        rows = rows[req.prompt_len :]
    return rows if columns is None else rows[:, columns]


def request_figures(
    req: TraceRequest, rows: np.ndarray, num_experts: int, part: str = "all"
) -> dict:
    """One request's shape plus routing figures averaged over its layers.

    ``rows`` are the rows of ``part`` (all, prompt or output tokens), which the
    figures describe: ``top1_repeat``: share of consecutive token pairs whose
    top-1 expert is the same; ``experts_touched``: distinct experts a layer
    used, as a share of all experts.
    """
    n, num_layers = rows.shape[0], rows.shape[1]
    repeat = float((rows[1:, :, 0] == rows[:-1, :, 0]).mean()) if n > 1 else None
    touched = (
        float(np.mean([len(np.unique(rows[:, i])) for i in range(num_layers)]) / num_experts)
        if n
        else None
    )
    return {
        "id": req.id,
        "index": req.index,
        "record": req.position,
        "prompt_len": req.prompt_len,
        "output_len": req.output_len,
        "part": part,
        "rows": int(n),
        "finish_reason": req.finish_reason,
        "num_cached_tokens": req.num_cached_tokens,
        "num_preemptions": req.num_preemptions,
        "top1_repeat": repeat,
        "experts_touched": touched,
    }


def request_table(
    trace: Trace, positions: np.ndarray, columns: np.ndarray | None = None, part: str = "all"
) -> list[dict]:
    return [
        request_figures(req, _routing(req, columns, part), trace.num_experts, part)
        for req in (trace.request(int(p)) for p in positions)
    ]


def token_view(
    trace: Trace,
    position: int,
    text: TokenText,
    columns: np.ndarray | None = None,
    part: str = "all",
) -> dict:
    """Every token of one request with its routed experts per layer.

    The last sampled token of a finished request was never run through the
    model; it is listed with ``experts`` null.
    """
    req = trace.request(position)
    rows = _routing(req, columns)
    tokens = np.concatenate([req.prompt_token_ids, req.output_token_ids]).tolist()
    texts = text.sequence(tokens)  # a character split over tokens reads where it completes
    entries = []
    for t, token in enumerate(tokens):
        is_prompt = t < req.prompt_len
        if (part == "prompt" and not is_prompt) or (part == "output" and is_prompt):
            continue
        entries.append(
            {
                "position": t,
                "part": "prompt" if is_prompt else "output",
                "token": token,
                "text": texts[t],
                "experts": rows[t].tolist() if t < len(rows) else None,
            }
        )
    return {
        "id": req.id,
        "record": req.position,
        "prompt_len": req.prompt_len,
        "output_len": req.output_len,
        "finish_reason": req.finish_reason,
        "tokens": entries,
    }
