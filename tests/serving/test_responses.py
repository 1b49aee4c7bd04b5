"""Response bodies with routed experts spliced in unscanned are the JSON ``json.dumps`` writes."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("starlette")

from moetrace.serving.responses import Base64Text, dumps  # noqa: E402


def _plain(value):
    """``value`` with every Base64Text replaced by its string."""
    if isinstance(value, Base64Text):
        return value.text
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _starlette_json(value) -> str:
    return json.dumps(_plain(value), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _b64(seed: int, size: int) -> Base64Text:
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    return Base64Text(base64.b64encode(raw).decode())


def test_a_body_with_several_blobs_is_what_starlette_writes():
    body = {
        "id": "cmpl-1",
        "choices": [
            {"index": i, "text": f'a "quoted"\n\u00e9 {i}', "routed_experts": _b64(i, 1000 + i)}
            for i in range(3)
        ],
        "meta_info": {"routed_experts": _b64(9, 7), "routed_weights": _b64(10, 0)},
        "usage": None,
    }
    out = dumps(body)
    assert out == _starlette_json(body)
    assert (
        json.loads(out)["choices"][2]["routed_experts"] == body["choices"][2]["routed_experts"].text
    )


def test_text_that_looks_like_a_marker_stays_text():
    from moetrace.serving import responses

    fake = responses._MARK.replace(responses._MARK[1:9], "00000000") + "0"
    body = {"text": fake, "also": '"' + responses._MARK[:5], "routed_experts": _b64(1, 30)}
    assert dumps(body) == _starlette_json(body)


def test_anything_else_json_cannot_write_is_refused():
    with pytest.raises(TypeError, match="bytes"):
        dumps({"x": b"raw"})


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.builds(_b64, st.integers(0, 99), st.integers(0, 64)),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_any_payload_is_what_starlette_writes(payload):
    assert dumps(payload) == _starlette_json(payload)
