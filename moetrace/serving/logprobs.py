"""Log-probabilities in the shapes OpenAI (completions, chat) and SGLang return them.

The engine gives, per output token, the sampled token's log-probability and
the N most likely tokens with theirs, from the model's raw distribution; the
values are vLLM's.  Token strings are each token decoded alone, as vLLM does;
``-inf`` becomes -9999.0, as vLLM (and OpenAI) send it.  JSON has no NaN:
a model whose weights went bad answers ``null`` there (SGLang's JSON writer
does the same for every non-finite value) rather than failing the request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moetrace.engine.request import TokenLogprob
from moetrace.serving.text import Decoder
from moetrace.trace.records import OutputLogprobs

FLOOR = -9999.0


@dataclass
class TokenLogprobs:
    """One output token's log-probability and the top N."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def from_request(items: Sequence[TokenLogprob], n: int) -> list[TokenLogprobs]:
    """From the engine's running request (streaming)."""
    return [
        TokenLogprobs(float(t.logprob), t.top_ids[:n].tolist(), t.top_logprobs[:n].tolist())
        for t in items
    ]


def from_output(out: OutputLogprobs, start: int = 0) -> list[TokenLogprobs]:
    """From a finished request, tokens ``start`` on."""
    return [
        TokenLogprobs(float(lp), ids.tolist(), lps.tolist())
        for lp, ids, lps in zip(
            out.token_logprob[start:], out.top_ids[start:], out.top_logprobs[start:], strict=True
        )
    ]


def _lp(value: float) -> float | None:
    """OpenAI's value: floored at -9999.0; NaN (or +inf) as null."""
    return None if math.isnan(value) or value == math.inf else max(value, FLOOR)


def _sglang_lp(value: float) -> float | None:
    """SGLang's value: as it is, or null where not finite."""
    return value if math.isfinite(value) else None


def _token(decoder: Decoder | None, token_id: int) -> str:
    if decoder is None:
        return f"token_id:{token_id}"
    return decoder.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    decoder: Decoder | None,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    text_offset: int = 0,
) -> dict:
    """``choices[i].logprobs`` of ``/v1/completions``: the sampled token first in each top dict."""
    tokens, offsets, top = [], [], []
    for token_id, item in zip(token_ids, logprobs, strict=True):
        text = _token(decoder, token_id)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(text)
        ranked = {text: _lp(item.logprob)}
        for top_id, top_lp in zip(item.top_ids, item.top_logprobs, strict=True):
            ranked.setdefault(_token(decoder, top_id), _lp(top_lp))
        top.append(ranked)
    return {
        "text_offset": offsets,
        "token_logprobs": [_lp(x.logprob) for x in logprobs],
        "tokens": tokens,
        "top_logprobs": top,
    }


def _chat_entry(decoder: Decoder | None, token_id: int, logprob: float) -> dict:
    text = _token(decoder, token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    decoder: Decoder | None, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
) -> dict:
    """``choices[i].logprobs`` of ``/v1/chat/completions``."""
    content = []
    for token_id, item in zip(token_ids, logprobs, strict=True):
        entry = _chat_entry(decoder, token_id, item.logprob)
        entry["top_logprobs"] = [
            _chat_entry(decoder, i, lp)
            for i, lp in zip(item.top_ids, item.top_logprobs, strict=True)
        ]
        content.append(entry)
    return {"content": content}


def sglang_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], top_n: int
) -> dict:
    """SGLang's ``meta_info`` entries: ``[logprob, token_id, None]`` per token."""
    out: dict = {
        "output_token_logprobs": [
            [_sglang_lp(item.logprob), int(t), None]
            for t, item in zip(token_ids, logprobs, strict=True)
        ]
    }
    if top_n:
        out["output_top_logprobs"] = [
            [
                [_sglang_lp(lp), i, None]
                for i, lp in zip(item.top_ids, item.top_logprobs, strict=True)
            ]
            for item in logprobs
        ]
    return out
