"""Log-probabilities a broken model gives (NaN, infinities) still make a JSON answer."""

from __future__ import annotations

import json
import math

from moetrace.serving.logprobs import (
    FLOOR,
    TokenLogprobs,
    chat_logprobs,
    completion_logprobs,
    sglang_logprobs,
)
from moetrace.serving.responses import dumps

ITEMS = [
    TokenLogprobs(math.nan, [5, 6], [math.nan, -math.inf]),
    TokenLogprobs(-math.inf, [7, 8], [-0.5, math.inf]),
    TokenLogprobs(-0.25, [9, 10], [-0.25, -1e6]),
]
TOKENS = [5, 7, 9]


def round_trip(payload: dict) -> dict:
    return json.loads(dumps(payload))  # refuses NaN and infinities, as the server does


def test_openai_shapes_floor_minus_infinity_and_send_nan_as_null():
    completion = round_trip(completion_logprobs(None, TOKENS, ITEMS))
    assert completion["token_logprobs"] == [None, FLOOR, -0.25]
    assert completion["top_logprobs"][1] == {"token_id:7": FLOOR, "token_id:8": None}
    assert completion["top_logprobs"][2]["token_id:10"] == FLOOR
    chat = round_trip(chat_logprobs(None, TOKENS, ITEMS))["content"]
    assert [entry["logprob"] for entry in chat] == [None, FLOOR, -0.25]
    assert [top["logprob"] for top in chat[0]["top_logprobs"]] == [None, FLOOR]


def test_sglang_shape_sends_every_non_finite_value_as_null():
    meta = round_trip(sglang_logprobs(TOKENS, ITEMS, top_n=2))
    assert meta["output_token_logprobs"] == [[None, 5, None], [None, 7, None], [-0.25, 9, None]]
    assert meta["output_top_logprobs"][1] == [[-0.5, 7, None], [None, 8, None]]
    assert meta["output_top_logprobs"][2][1] == [-1e6, 10, None]
