"""``moetrace serve --enable-return-routed-weights``: gate weights on request, over real HTTP.

A request with ``return_routed_weights`` gets, beside its routed experts, the
weights ``moetrace record --record-weights`` writes for the same prompt: in
vLLM's layout (``.npy``, every hidden layer, dense ones zero) on the OpenAI
endpoints, as flat float32 on SGLang's ``/generate``.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from support.serve import (
    DEMO_HIDDEN_LAYERS,
    DEMO_MOE_LAYERS,
    DEMO_TOP_K,
    ServerProcess,
    record_demo,
)

from moetrace import open_trace

MAX_TOKENS = 10
PROMPT = "def fibonacci(n):"
# float32 on the CPU: a request batched differently rounds its matmuls differently.
CLOSE = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("serve-weights") / "served.h5"
    srv = ServerProcess(
        "demo", "--device", "cpu", "--enable-return-routed-weights", "--weights-dtype",
        "float32", "--num-kv-blocks", "256", "--trace-out", str(trace), "--shutdown-timeout", "5",
    )  # fmt: skip
    srv.trace = trace
    yield srv
    assert srv.stop() == 0, srv.stderr


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("record-weights")
    rows = record_demo(tmp, [{"id": "p", "prompt": PROMPT}], MAX_TOKENS, "cpu",
                       "--record-weights", "--weights-dtype", "float32")  # fmt: skip
    with open_trace(tmp / "record.h5") as trace:
        rows["p"]["weights"] = trace.request("p").routed_weights
    return rows["p"]


def moe_layers(rows: np.ndarray) -> np.ndarray:
    assert rows.shape[1:] == (DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    dense = [i for i in range(DEMO_HIDDEN_LAYERS) if i not in DEMO_MOE_LAYERS]
    assert not rows[:, dense].any()
    return rows[:, DEMO_MOE_LAYERS]


def npy(encoded: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def test_completion_weights_are_what_record_writes(server, recorded):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = dict(model="demo", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    out = client.completions.create(**body, extra_body={"return_routed_weights": True})
    choice = out.model_dump()["choices"][0]
    weights = npy(choice["routed_weights"])
    assert weights.dtype == np.float32
    np.testing.assert_allclose(moe_layers(weights), recorded["weights"], **CLOSE)
    assert choice["routed_experts"] is None  # the server returns experts only when asked to
    plain = client.completions.create(**body).model_dump()["choices"][0]
    assert "routed_weights" not in plain  # nothing extra unless asked: vLLM's response
    start = client.completions.create(
        **body, extra_body={"return_routed_weights": True, "routed_experts_prompt_start": 4}
    )
    tail = npy(start.model_dump()["choices"][0]["routed_weights"])
    np.testing.assert_allclose(moe_layers(tail), recorded["weights"][4:], **CLOSE)


def test_chat_stream_ends_with_the_weights(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What is routing?"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"return_routed_weights": True},
        )
    )
    last = chunks[-1].model_dump()["choices"][0]
    weights = moe_layers(npy(last["routed_weights"]))
    assert last["finish_reason"] is not None and (weights > 0).all()


def test_sglang_generate_sends_flat_float32(server, recorded):
    out = httpx.post(
        server.url + "/generate",
        json={
            "input_ids": recorded["prompt"],
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
            "return_routed_weights": True,
            "routed_experts_start_len": 3,
        },
        timeout=60,
    ).json()
    flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_weights"]), "<f4")
    rows = flat.reshape(-1, DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    np.testing.assert_allclose(moe_layers(rows), recorded["weights"][3:], **CLOSE)
    assert "routed_experts" not in out["meta_info"]


def test_the_served_trace_keeps_the_weights(server):
    server.wait_idle()
    with open_trace(server.trace) as trace:  # readable while the server writes it
        assert trace.weights_dtype == "float32"
        assert all(req.routed_weights.shape == req.routed_experts.shape for req in trace)
