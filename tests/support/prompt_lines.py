"""Prompt lines, valid and nearly valid, for the prompt parser tests and the fuzzers."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from moetrace.errors import InputError
from moetrace.inputs.prompts import (
    parse_line,
)

NAME = "prompts.jsonl"
MSGS = [{"role": "user", "content": "hi"}]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


KEYS = [
    "id", "prompt", "prompt_token_ids", "messages", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "seed", "stop_token_ids", "custom_id", "method", "url",
    "body", "model", "stop", "n", "stream", "role", "content", "type", "text",
]  # fmt: skip


keyed = st.deferred(
    lambda: st.dictionaries(
        st.sampled_from(KEYS),
        json_values
        | keyed
        | st.lists(keyed, max_size=3)
        | st.lists(st.integers(-2, 300), max_size=4)
        | st.sampled_from(["/v1/completions", "/v1/chat/completions", "POST", "user"]),
        max_size=5,
    )
)


VALID = [
    {"prompt": "p", "max_tokens": 2},
    {"prompt_token_ids": [1, 2], "top_k": 3},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5},
    {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": MSGS, "seed": 1}},
    {"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 0.5}},
]


@st.composite
def near_valid(draw) -> dict:
    """A valid line with one field (maybe inside body) replaced, added or removed."""
    obj = json.loads(json.dumps(draw(st.sampled_from(VALID))))
    target = obj["body"] if "body" in obj and draw(st.booleans()) else obj
    key = draw(st.sampled_from(KEYS))
    if draw(st.integers(0, 3)) == 0:
        target.pop(key, None)
    else:
        target[key] = draw(
            json_values | st.lists(st.integers(-2, 300), max_size=4) | st.sampled_from([MSGS, 1, 0])
        )
    return obj


lines = (
    st.binary(max_size=40)
    | near_valid().map(json.dumps)
    | json_values.map(json.dumps)
    | keyed.map(json.dumps)
    | keyed.map(lambda d: json.dumps(d)[: len(json.dumps(d)) // 2])
)


def _valid_or_input_error(text: str) -> None:
    try:
        spec = parse_line(text, source="f", line=1)
    except InputError:
        return
    assert sum(x is not None for x in (spec.text, spec.token_ids, spec.messages)) == 1
