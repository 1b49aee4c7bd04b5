"""``/metrics``: Prometheus' text format through ``prometheus_client``, with vLLM's names.

Where vLLM has a metric, moetrace uses its name with the ``vllm:`` prefix
replaced by ``moetrace:`` (and its histogram buckets), so dashboards written
for vLLM need only the prefix changed.  Every series has vLLM's
``model_name`` label.  The ``kv_cache_*_blocks``, ``requests_aborted`` and
``engine_steps`` series are moetrace's own.

Latencies: end to end from the request's arrival at the engine loop to its
end; queue time and time to first token as the engine measured them (from
the request's arrival in the engine to its first scheduled step, and to its
first sampled token).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from moetrace.trace.records import FinishedRequest

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket bounds for these histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """The server's series, in a registry of its own (no process-wide state)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"moetrace:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"moetrace:{name}", doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"moetrace:{name}", doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block used.")
        self.kv_free = gauge("kv_cache_free_blocks", "Free KV-cache blocks.")
        self.kv_total = gauge("kv_cache_total_blocks", "KV-cache blocks in all.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = counter(
            "request_success", "Requests ended, by finish reason.", ("finished_reason",)
        )
        self.aborted = counter("requests_aborted", "Requests aborted (disconnect, shutdown).")
        self.preemptions = counter("num_preemptions", "Preemptions of ended requests.")
        self.steps = counter("engine_steps", "Engine steps run.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first output token.", TTFT_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to end.", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting before the first step.", LATENCY_BUCKETS
        )
        self.model_name = model_name
        self._series = {
            name: getattr(self, name).labels(model_name)
            for name in (
                "running", "waiting", "kv_usage", "kv_free", "kv_total", "prompt_tokens",
                "generation_tokens", "aborted", "preemptions", "steps", "ttft", "e2e", "queue",
            )
        }  # fmt: skip

    def ended(self, done: FinishedRequest, latency_s: float | None) -> None:
        """Count one request that ended in the engine (from the engine loop's thread)."""
        s = self._series
        s["prompt_tokens"].inc(done.prompt_len)
        s["generation_tokens"].inc(done.output_len)
        s["preemptions"].inc(done.num_preemptions)
        self.success.labels(self.model_name, done.finish_reason).inc()
        if done.finish_reason == "abort":
            s["aborted"].inc()
        if latency_s is not None:
            s["e2e"].observe(latency_s)
        if done.queue_s is not None:
            s["queue"].observe(done.queue_s)
        if done.first_token_s is not None:
            s["ttft"].observe(done.first_token_s)

    def stepped(self, steps: int) -> None:
        self._series["steps"].inc(steps)

    def render(self, counts: dict[str, int]) -> bytes:
        """The exposition, gauges read now from the engine's ``counts``."""
        s = self._series
        total = counts["kv_cache_total_blocks"]
        s["running"].set(counts["num_requests_running"])
        s["waiting"].set(counts["num_requests_waiting"])
        s["kv_free"].set(counts["kv_cache_free_blocks"])
        s["kv_total"].set(total)
        s["kv_usage"].set(1 - counts["kv_cache_free_blocks"] / total if total else 0.0)
        return generate_latest(self.registry)
