"""Per-request and per-token views, each request read on its own from the table's offsets."""

from __future__ import annotations

import numpy as np

from moetrace.analysis.tokens import TokenText
from moetrace.trace.reader import Trace, TraceRequest


def _routing(req: TraceRequest, columns: np.ndarray | None) -> np.ndarray:
    rows = req.routed_experts
    return rows if columns is None else rows[:, columns]


def request_figures(req: TraceRequest, rows: np.ndarray, num_experts: int) -> dict:
    """One request's shape plus routing figures averaged over its layers.

    ``top1_repeat``: share of consecutive token pairs whose top-1 expert is the
    same; ``experts_touched``: distinct experts a layer used for this request,
    as a share of all experts.
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
        "rows": req.num_rows,
        "finish_reason": req.finish_reason,
        "num_cached_tokens": req.num_cached_tokens,
        "num_preemptions": req.num_preemptions,
        "top1_repeat": repeat,
        "experts_touched": touched,
    }


def request_table(
    trace: Trace, positions: np.ndarray, columns: np.ndarray | None = None
) -> list[dict]:
    return [
        request_figures(req, _routing(req, columns), trace.num_experts)
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
    tokens = np.concatenate([req.prompt_token_ids, req.output_token_ids])
    entries = []
    for t, token in enumerate(tokens.tolist()):
        is_prompt = t < req.prompt_len
        if (part == "prompt" and not is_prompt) or (part == "output" and is_prompt):
            continue
        entries.append(
            {
                "position": t,
                "part": "prompt" if is_prompt else "output",
                "token": token,
                "text": text.text(token),
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
