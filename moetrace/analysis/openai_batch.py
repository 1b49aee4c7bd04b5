"""``export --format openai-batch``: the output file ``vllm run-batch`` writes, made from a trace.

One line per input line (vLLM's ``BatchRequestOutput``): ``id``, ``custom_id``
(the request id, which a batch line's ``custom_id`` became), ``response``
(``status_code`` 200, ``request_id``, ``body``) and ``error`` null.  The body
is the chat or completion response the line asked for (a record's
``extra.url`` says a chat), each of a prompt's ``n`` samples one choice, with
vLLM's extensions as ``return_token_ids`` gives them: ``token_ids`` per
choice, ``prompt_token_ids`` (per choice for completions, in the body for a
chat) and ``routed_experts`` in vLLM's wire format (base64 ``.npy`` over every
hidden layer, dense layers zero), plus ``routed_weights`` the same way when
the trace holds them, as ``moetrace serve`` returns them.  A pipeline written
for run-batch's output reads this file unchanged.

``logprobs`` is filled for a request that asked for them, from what the trace
keeps: the sampled token's log-probability; the alternatives (``top_logprobs``)
are not stored, so they are empty.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import TextIO

import numpy as np

from moetrace.analysis.export import ROUTED_EXPERTS, ROUTED_WEIGHTS, Layout, request_array
from moetrace.errors import MoetraceError
from moetrace.inputs.prompts import CHAT_URL
from moetrace.trace.reader import Trace, TraceRequest
from moetrace.trace.wire import npy_base64


def write_openai_batch(
    trace: Trace, positions: np.ndarray | None, out: TextIO, dtype: str = "stored"
) -> int:
    """The chosen requests as run-batch output lines, in input order; returns how many lines."""
    if trace.tokenizer is None:
        raise MoetraceError(
            f"{trace.path} carries no tokenizer, and --format openai-batch needs one for the "
            "text of each choice"
        )
    layout = Layout.of(trace, "vllm")
    created = _epoch(trace.metadata.get("created"))
    n = 0
    for samples in _by_input_line(trace, positions):
        line = batch_line(samples, trace.metadata.get("model", ""), created, layout, dtype)
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        n += 1
    return n


def _by_input_line(trace: Trace, positions: np.ndarray | None) -> Iterator[list[TraceRequest]]:
    """The samples of each input line together, lines in input order."""
    t = trace.requests
    chosen = np.arange(len(t)) if positions is None else np.asarray(positions)
    order = chosen[np.lexsort((trace.sample_indices[chosen], t["index"][chosen]))]
    group: list[TraceRequest] = []
    for pos in order.tolist():
        req = trace.request(pos)
        if group and (req.id, req.index) != (group[0].id, group[0].index):
            yield group
            group = []
        group.append(req)
    if group:
        yield group


def batch_line(
    samples: list[TraceRequest], model: str, created: int, layout: Layout, dtype: str
) -> dict:
    """vLLM's ``BatchRequestOutput`` for one input line and its samples."""
    first = samples[0]
    chat = first.extra.get("url") == CHAT_URL
    choices = [_choice(i, req, chat, layout, dtype) for i, req in enumerate(samples)]
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{first.id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": first.prompt_len,
            "total_tokens": first.prompt_len + sum(r.output_len for r in samples),
            "completion_tokens": sum(r.output_len for r in samples),
            "prompt_tokens_details": None,
        },
    }
    if chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = first.prompt_token_ids.tolist()
    return {
        "id": f"moetrace-{first.index}",
        "custom_id": first.id,
        "response": {
            "status_code": 200,
            "request_id": f"moetrace-batch-{first.index}",
            "body": body,
        },
        "error": None,
    }


def _choice(i: int, req: TraceRequest, chat: bool, layout: Layout, dtype: str) -> dict:
    text = req.output_text or ""
    choice: dict = {"index": i}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = _logprobs(req, chat)
    choice["finish_reason"] = req.finish_reason
    choice["stop_reason"] = req.stop_reason
    choice["token_ids"] = req.output_token_ids.tolist()
    if not chat:
        choice["prompt_logprobs"] = None
        choice["prompt_token_ids"] = req.prompt_token_ids.tolist()
    choice[ROUTED_EXPERTS] = npy_base64(request_array(req, ROUTED_EXPERTS, dtype, layout))
    if req.routed_weights is not None:
        choice[ROUTED_WEIGHTS] = npy_base64(request_array(req, ROUTED_WEIGHTS, layout=layout))
    return choice


def _logprobs(req: TraceRequest, chat: bool) -> dict | None:
    """OpenAI's logprobs object for a request that asked, from the stored log-probabilities."""
    if req.output_logprobs is None or req.sampling_params.get("logprobs") is None:
        return None
    tok = req.text_tokenizer() if req.text_tokenizer is not None else None
    ids = req.output_token_ids.tolist()
    pieces = [tok.decode([i], skip_special_tokens=False) if tok else "" for i in ids]
    values = [float(v) for v in req.output_logprobs]
    if chat:
        content = [
            {"token": p, "logprob": v, "bytes": list(p.encode("utf-8")), "top_logprobs": []}
            for p, v in zip(pieces, values, strict=True)
        ]
        return {"content": content}
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])[:-1]]).astype(int)
    return {
        "text_offset": offsets.tolist() if pieces else [],
        "token_logprobs": values,
        "tokens": pieces,
        "top_logprobs": None,
    }


def _epoch(created: str | None) -> int:
    """The trace's creation time (ISO-8601 UTC) as the Unix time a response's ``created`` is."""
    if not created:
        return 0
    return int(datetime.fromisoformat(str(created).replace("Z", "+00:00")).timestamp())
