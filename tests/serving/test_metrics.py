"""``/metrics`` read by Prometheus' own parser: vLLM's names under ``moetrace:``, counts that move."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serve import ServerProcess

KEY = "metrics-key"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("demo", "--device", "cpu", "--api-key", KEY, "--public-metrics",
                        "--shutdown-timeout", "1")  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.stderr


def families(url: str) -> dict:
    r = httpx.get(url + "/metrics", timeout=10)  # --public-metrics: no key needed
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# HELP moetrace:time_to_first_token_seconds" in r.text
    assert "# TYPE moetrace:e2e_request_latency_seconds histogram" in r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(fams: dict, name: str, suffix: str = "", **labels) -> float:
    family = fams[f"moetrace:{name}"]
    for s in family.samples:
        if s.name == f"moetrace:{name}{suffix}" and all(
            s.labels.get(k) == v for k, v in labels.items()
        ):
            return s.value
    return 0.0


def test_vllm_names_and_types(server):
    fams = families(server.url)
    kinds = {
        "time_to_first_token_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
        "request_queue_time_seconds": "histogram",
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "kv_cache_usage_perc": "gauge",
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "request_success": "counter",
    }
    for name, kind in kinds.items():
        assert fams[f"moetrace:{name}"].type == kind, name
    running = fams["moetrace:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "demo"}


def test_counts_follow_the_requests(server):
    before = families(server.url)
    headers = {"authorization": f"Bearer {KEY}"}
    prompt_tokens = generated = 0
    for i in range(3):
        r = httpx.post(
            server.url + "/v1/completions",
            json={
                "prompt": f"count me {i}",
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            },  # fmt: skip
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
        generated += r.json()["usage"]["completion_tokens"]
    after = families(server.url)

    def grew(name: str, suffix: str = "", **labels) -> float:
        return sample(after, name, suffix, **labels) - sample(before, name, suffix, **labels)

    assert grew("prompt_tokens", "_total") == prompt_tokens
    assert grew("generation_tokens", "_total") == generated == 12
    assert grew("request_success", "_total", finished_reason="length") == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):  # fmt: skip
        assert grew(name, "_count") == 3, name
        assert grew(name, "_sum") > 0, name
    assert grew("e2e_request_latency_seconds", "_sum") >= grew(
        "time_to_first_token_seconds", "_sum"
    )
    assert 0 <= sample(after, "kv_cache_usage_perc") <= 1
