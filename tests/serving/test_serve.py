"""``moetrace serve`` over real HTTP on loopback: the official OpenAI client, curl, httpx.

One server process serves the whole module (the demo model on the CPU). The
routed experts it returns are checked against what ``moetrace record`` writes
for the same prompts, decoded with vLLM's and SGLang's own rules.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

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
    sglang_decode,
    vllm_decode,
)

from moetrace import open_trace
from moetrace.serving.server import SWITCH_INTERVAL_MS, switch_interval_s

MAX_TOKENS = 12
PROMPTS = {
    "plain": "def fibonacci(n):",
    "prose": "The experts of a mixture",
}
CHAT = [{"role": "user", "content": "What is routing?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("serve") / "served.h5"
    srv = ServerProcess(
        "demo",
        "--device",
        "cpu",
        "--enable-return-routed-experts",
        "--trace-out",
        str(trace),
        "--num-kv-blocks",
        "256",
        "--shutdown-timeout",
        "5",
    )
    srv.trace = trace
    yield srv
    code = srv.stop()
    assert code == 0, srv.stderr


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    lines = [{"id": k, "prompt": v} for k, v in PROMPTS.items()]
    lines.append({"id": "chat", "messages": CHAT})
    return record_demo(tmp_path_factory.mktemp("record"), lines, MAX_TOKENS)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def moe_layers(vllm_rows: np.ndarray) -> np.ndarray:
    """The MoE layers of vLLM's layout, after checking the dense layer is zero."""
    assert vllm_rows.shape[1:] == (DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    dense = [i for i in range(DEMO_HIDDEN_LAYERS) if i not in DEMO_MOE_LAYERS]
    assert not vllm_rows[:, dense].any()
    return vllm_rows[:, DEMO_MOE_LAYERS]


def greedy(**extra):
    return {"max_tokens": MAX_TOKENS, "temperature": 0, **extra}


# ------------------------------------------------------------------- routed experts


def test_completion_returns_what_record_writes(client, recorded):
    for key, prompt in PROMPTS.items():
        out = client.completions.create(
            model="demo", prompt=prompt, **greedy(), extra_body={"return_token_ids": True}
        )
        choice = out.model_dump()["choices"][0]
        want = recorded[key]
        assert choice["prompt_token_ids"] == want["prompt"]
        assert choice["token_ids"] == want["output"]
        rows = vllm_decode(choice["routed_experts"])
        assert rows.dtype == np.uint8  # 16 experts: vLLM's newest dtype rule
        assert rows.shape[0] == len(want["prompt"]) + len(want["output"]) - 1
        np.testing.assert_array_equal(moe_layers(rows), want["rows"])


def test_chat_returns_what_record_writes(client, recorded):
    out = client.chat.completions.create(
        model="demo", messages=CHAT, **greedy(), extra_body={"return_token_ids": True}
    )
    body = out.model_dump()
    want = recorded["chat"]
    assert body["prompt_token_ids"] == want["prompt"]
    choice = body["choices"][0]
    assert choice["token_ids"] == want["output"]
    np.testing.assert_array_equal(moe_layers(vllm_decode(choice["routed_experts"])), want["rows"])


def test_prompt_start_omits_the_rows_a_client_has(client, recorded):
    want = recorded["plain"]
    out = client.completions.create(
        model="demo",
        prompt=PROMPTS["plain"],
        **greedy(),
        extra_body={"routed_experts_prompt_start": 5},
    )
    rows = vllm_decode(out.model_dump()["choices"][0]["routed_experts"])
    np.testing.assert_array_equal(moe_layers(rows), want["rows"][5:])
    # vLLM 0.33 takes 0 <= start <= prompt_len: at the prompt's length, the output's rows only.
    at_end = client.completions.create(
        model="demo",
        prompt=PROMPTS["plain"],
        **greedy(),
        extra_body={"routed_experts_prompt_start": len(want["prompt"])},
    )
    rows = vllm_decode(at_end.model_dump()["choices"][0]["routed_experts"])
    np.testing.assert_array_equal(moe_layers(rows), want["rows"][len(want["prompt"]) :])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="demo",
            prompt=PROMPTS["plain"],
            **greedy(),
            extra_body={"routed_experts_prompt_start": len(want["prompt"]) + 1},
        )
    assert err.value.body["param"] == "routed_experts_prompt_start"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/update_weights_from_disk"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/pause_generation"),
        ("GET", "/flush_cache"),
        ("POST", "/release_memory_occupation"),
        ("POST", "/pause"),
        ("POST", "/update_weights"),
        ("POST", "/sleep"),
    ],
)
def test_control_routes_exist_only_with_enable_weight_updates(server, method, path):
    answer = httpx.request(method, server.url + path, json={}, timeout=30)
    assert answer.status_code == 404, answer.text
    version = httpx.get(server.url + "/get_weight_version", timeout=30)
    assert version.json() == {"weight_version": "default"}


def test_stream_ends_with_the_routed_experts(client):
    whole = client.completions.create(
        model="demo", prompt=PROMPTS["prose"], **greedy(), extra_body={"return_token_ids": True}
    ).model_dump()["choices"][0]
    text, tokens, final = "", [], None
    stream = client.completions.create(
        model="demo",
        prompt=PROMPTS["prose"],
        stream=True,
        **greedy(),
        extra_body={"return_token_ids": True},
    )
    for chunk in stream:
        choice = chunk.model_dump()["choices"][0]
        text += choice["text"]
        tokens += choice["token_ids"] or []
        if choice["finish_reason"] is not None:
            final = choice
        else:
            assert choice.get("routed_experts") is None
    assert final is not None and final["routed_experts"] is not None
    assert text == whole["text"]
    assert tokens == whole["token_ids"]
    np.testing.assert_array_equal(
        vllm_decode(final["routed_experts"]), vllm_decode(whole["routed_experts"])
    )


def test_chat_stream_ends_with_the_routed_experts(client, recorded):
    pieces, final = [], None
    for chunk in client.chat.completions.create(
        model="demo", messages=CHAT, stream=True, **greedy()
    ):
        choice = chunk.model_dump()["choices"][0]
        pieces.append(choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            final = choice
    want = recorded["chat"]
    np.testing.assert_array_equal(moe_layers(vllm_decode(final["routed_experts"])), want["rows"])


def test_n_samples_are_parallel_requests_with_seed_plus_index(client):
    sampled = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=11)
    out = client.completions.create(
        model="demo", prompt=PROMPTS["prose"], n=3, **sampled, extra_body={"return_token_ids": True}
    ).model_dump()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1
    for i, choice in enumerate(out["choices"]):
        alone = client.completions.create(
            model="demo",
            prompt=PROMPTS["prose"],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=11 + i,
            extra_body={"return_token_ids": True},
        ).model_dump()["choices"][0]
        assert choice["token_ids"] == alone["token_ids"]
        np.testing.assert_array_equal(
            vllm_decode(choice["routed_experts"]), vllm_decode(alone["routed_experts"])
        )
        n_prompt = len(choice["prompt_token_ids"])
        assert len(vllm_decode(choice["routed_experts"])) == n_prompt + len(choice["token_ids"]) - 1


def test_64_concurrent_requests_each_equal_their_solo_result(server):
    prompts = [f"{i} experts route token {i * 7}" for i in range(64)]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(prompt: str):
            out = await aclient.completions.create(
                model="demo",
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            c = out.model_dump()["choices"][0]
            return c["token_ids"], vllm_decode(c["routed_experts"])

        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts]
        await aclient.close()
        return together, alone

    together, alone = asyncio.run(run())
    for (tokens, rows), (solo_tokens, solo_rows) in zip(together, alone, strict=True):
        assert tokens == solo_tokens
        np.testing.assert_array_equal(rows, solo_rows)


def test_weights_need_a_server_that_captures_them(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="demo", prompt="Hi", **greedy(), extra_body={"return_routed_weights": True}
        )
    assert err.value.body["param"] == "return_routed_weights"
    assert "--enable-return-routed-weights" in err.value.body["message"]


def test_sglang_generate_decodes_with_sglangs_rule(server, recorded):
    want = recorded["plain"]
    out = httpx.post(
        server.url + "/generate",
        json={
            "input_ids": want["prompt"],
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
            "return_routed_experts": True,
            "routed_experts_start_len": 3,
        },
        timeout=60,
    ).json()
    assert out["output_ids"] == want["output"]
    flat = sglang_decode(out["meta_info"]["routed_experts"], DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    rows = flat.reshape(-1, DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    np.testing.assert_array_equal(moe_layers(rows), want["rows"][3:])
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_gets_the_same_answer(server, recorded):
    body = json.dumps({"prompt": PROMPTS["plain"], **greedy()})
    proc = subprocess.run(
        [
            "curl",
            "-sS",
            server.url + "/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    choice = json.loads(proc.stdout)["choices"][0]
    np.testing.assert_array_equal(
        moe_layers(vllm_decode(choice["routed_experts"])), recorded["plain"]["rows"]
    )


# ---------------------------------------------------------------------------- faults


def test_errors_are_openai_json_and_the_server_keeps_serving(server, client):
    url = server.url + "/v1/completions"
    cases = [
        (b'{"prompt": "x",', 400, None),
        (json.dumps({"prompt": "x", "max_tokens": "ten"}), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_token": 3}), 400, "max_token"),
        (json.dumps({"prompt": "x", "echo": True}), 400, "echo"),
        (json.dumps({"prompt": "x" * 1100}), 400, "prompt"),
        (json.dumps({"prompt": "x", "max_tokens": 5000}), 400, "max_tokens"),
        (json.dumps({"prompt": [5, 999]}), 400, "prompt"),
        (json.dumps({"prompt": "x", "model": "gpt-4"}), 404, "model"),
        ("[1, 2]", 400, None),
    ]
    for body, status, param in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == status and error["param"] == param, (body, error)
        assert error["message"] and "Traceback" not in r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"bogus": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.bogus"
    assert httpx.get(server.url + "/nope").status_code == 404
    assert client.completions.create(model="demo", prompt="still here", max_tokens=2).choices


def test_disconnecting_clients_leak_no_blocks(server):
    before = server.wait_idle()
    total = before["kv_cache_total_blocks"]

    async def leave_early(stream: bool) -> None:
        body = {
            "prompt": "a long answer, please",
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        async with httpx.AsyncClient(timeout=30) as http:
            if stream:
                async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break  # the first chunk arrived: hang up
            else:
                with pytest.raises(httpx.TimeoutException):
                    await http.post(server.url + "/v1/completions", json=body, timeout=0.5)

    async def all_leave():
        await asyncio.gather(*(leave_early(i % 2 == 0) for i in range(6)))

    asyncio.run(all_leave())
    after = server.wait_idle()
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    assert after["kv_cache_free_blocks"] == total
    assert after["requests_aborted_total"] >= before["requests_aborted_total"] + 6


def test_trace_out_holds_what_was_served(tmp_path):
    trace = tmp_path / "t.h5"
    srv = ServerProcess(
        "demo",
        "--device",
        "cpu",
        "--enable-return-routed-experts",
        "--trace-out",
        str(trace),
        "--shutdown-timeout",
        "0.5",
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(
            model="demo",
            prompt="served and traced",
            **greedy(),
            extra_body={"return_token_ids": True},
        ).model_dump()["choices"][0]
        body = {
            "prompt": "still running",
            "max_tokens": 1000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # a request in flight when the signal comes
            code = srv.stop()
    finally:
        srv.stop()
    assert code == 0, srv.stderr
    assert "stopped by SIGTERM" in srv.stderr
    verify = subprocess.run(
        [sys.executable, "-m", "moetrace", "verify", str(trace)], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with open_trace(trace) as t:
        reqs = list(t)
    served = [r for r in reqs if r.output_token_ids.tolist() == out["token_ids"]]
    assert len(served) == 1
    np.testing.assert_array_equal(
        served[0].routed_experts, moe_layers(vllm_decode(out["routed_experts"]))
    )
    assert sorted(r.finish_reason for r in reqs) == ["abort", "length"]


def test_usage_errors_exit_2_and_bad_paths_exit_1(tmp_path):
    def serve(*args):
        return subprocess.run(
            [sys.executable, "-m", "moetrace", "serve", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    bad = serve("demo", "--uvicorn-log-level", "loud")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--uvicorn-log-level" in bad.stderr
    existing = tmp_path / "t.h5"
    existing.write_bytes(b"")
    taken = serve("demo", "--trace-out", str(existing))
    assert taken.returncode == 1 and "Traceback" not in taken.stderr
    assert taken.stderr.strip().splitlines() == [
        f"error: {existing} already exists (pass --overwrite to replace it)"
    ]


def test_a_bad_switch_interval_is_one_line_naming_the_variable():
    for value in ("fast", "0", "-1"):
        proc = subprocess.run(
            [sys.executable, "-m", "moetrace", "serve", "demo", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "MOETRACE_SERVE_SWITCH_INTERVAL_MS": value},
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("error: MOETRACE_SERVE_SWITCH_INTERVAL_MS must be"), line
        assert repr(value) in line


def test_switch_interval_defaults_and_follows_the_environment(monkeypatch):
    monkeypatch.delenv("MOETRACE_SERVE_SWITCH_INTERVAL_MS", raising=False)
    assert switch_interval_s() == SWITCH_INTERVAL_MS / 1e3
    monkeypatch.setenv("MOETRACE_SERVE_SWITCH_INTERVAL_MS", "0.05")
    assert switch_interval_s() == 0.05 / 1e3


# ------------------------------------------------------------- sampling features


def test_stop_string_cuts_text_and_keeps_the_rows_of_the_tokens_kept(client):
    base = client.completions.create(
        model="demo",
        prompt=PROMPTS["prose"],
        **greedy(max_tokens=24),
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]
    text = base["text"]
    stop = text[5:7]
    cut = text.find(stop)
    assert len(text) >= 8 and cut > 0 and text.isascii()  # the demo: one byte, one token
    out = client.completions.create(
        model="demo",
        prompt=PROMPTS["prose"],
        stop=[stop],
        **greedy(max_tokens=24),
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]
    assert out["text"] == text[:cut]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    kept = cut + len(stop)  # up to the token that completed the stop string
    assert out["token_ids"] == base["token_ids"][:kept]
    rows = vllm_decode(out["routed_experts"])
    n_prompt = len(base["prompt_token_ids"])
    np.testing.assert_array_equal(rows, vllm_decode(base["routed_experts"])[: n_prompt + kept - 1])
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo", prompt=PROMPTS["prose"], stop=[stop], stream=True, **greedy(max_tokens=24)
        )
    )
    assert streamed == out["text"]


def test_logprobs_line_up_with_the_sampled_tokens(client, server):
    out = client.completions.create(
        model="demo",
        prompt=PROMPTS["prose"],
        logprobs=3,
        **greedy(),
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]
    lp = out["logprobs"]
    assert len(lp["token_logprobs"]) == len(out["token_ids"]) == len(lp["top_logprobs"])
    for sampled, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 4 and sampled == pytest.approx(max(top.values()))  # greedy
    chat = client.chat.completions.create(
        model="demo", messages=CHAT, logprobs=True, top_logprobs=2, **greedy()
    ).model_dump()["choices"][0]["logprobs"]["content"]
    assert len(chat) == MAX_TOKENS and all(len(t["top_logprobs"]) == 2 for t in chat)
    assert all(t["logprob"] == pytest.approx(t["top_logprobs"][0]["logprob"]) for t in chat)
    gen = httpx.post(
        server.url + "/generate",
        json={
            "text": PROMPTS["prose"],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        },
        timeout=60,
    ).json()
    assert [t[1] for t in gen["meta_info"]["output_token_logprobs"]] == gen["output_ids"]


def test_penalties_and_min_tokens_reach_the_engine(client):
    def tokens(**extra):
        return client.completions.create(
            model="demo",
            prompt=PROMPTS["plain"],
            **greedy(max_tokens=16),
            extra_body={"return_token_ids": True, **extra},
        ).model_dump()["choices"][0]["token_ids"]

    plain = tokens()
    assert tokens(repetition_penalty=1.8) != plain  # the demo repeats spaces greedily
    assert tokens(frequency_penalty=1.5) != plain
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="demo", prompt="x", max_tokens=4, extra_body={"min_tokens": 9}
        )
    assert "min_tokens" in err.value.body["message"]


def test_tensor_parallel_server_returns_what_tensor_parallel_record_writes(tmp_path):
    lines = [{"id": k, "prompt": v} for k, v in PROMPTS.items()]
    recorded = record_demo(tmp_path, lines, MAX_TOKENS, "cpu", "--tensor-parallel-size", "2")
    srv = ServerProcess(
        "demo", "--device", "cpu", "--tensor-parallel-size", "2", "--enable-return-routed-experts"
    )
    try:
        for key, prompt in PROMPTS.items():
            body = {"prompt": prompt, **greedy(), "return_token_ids": True}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == recorded[key]["output"]
            rows = moe_layers(vllm_decode(choice["routed_experts"]))
            np.testing.assert_array_equal(rows, recorded[key]["rows"])
    finally:
        assert srv.stop() == 0, srv.stderr
