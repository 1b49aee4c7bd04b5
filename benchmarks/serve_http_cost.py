"""CPU time the HTTP side of ``moetrace serve`` spends per request, with no model behind it.

The serving benchmark (``benchmarks/serve.py``) shows that at the end of a
batch the event loop answers hundreds of requests at once, and that its
CPU per request bounds what serving can reach beside ``record``.  This
benchmark isolates that cost: the real application (``serving/app.py``:
routing, middleware, body parsing and validation, sampling checks, routed
experts encoded as vLLM encodes them, JSON, starlette responses) is called
in-process through ASGI, as uvicorn calls it, with a stub engine loop that
finishes each request at once with routed experts of the shape asked for.
What it times is everything between the socket and the engine, less
uvicorn's HTTP parsing and the socket writes.

    python benchmarks/serve_http_cost.py --requests 2000 --concurrency 256

Process CPU time over the run, divided by the requests (one thread: the
event loop's time).  Token-id prompts, greedy, routed experts returned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from moetrace.engine.heap import freeze_start_up_heap
from moetrace.serving.app import create_app
from moetrace.serving.context import ModelFacts, ServingContext
from moetrace.serving.engine_loop import Finished, LoopStats
from moetrace.trace.records import FinishedRequest


class StubLoop:
    """What the handlers use of ``EngineLoop``; each request finishes on the next turn."""

    def __init__(self, rows: np.ndarray, output_len: int) -> None:
        self.rows = rows
        self.output = np.arange(output_len, dtype=np.int32)
        self.stats = LoopStats()
        self.alive = True
        self.loop = asyncio.get_running_loop()

    def add(self, handle) -> None:
        req = handle.request
        done = FinishedRequest(
            request_id=req.request_id,
            index=0,
            prompt_token_ids=np.asarray(req.prompt_token_ids, dtype=np.int32),
            output_token_ids=self.output,
            routed_experts=self.rows,
            finish_reason="length",
        )
        self.loop.call_soon(handle.queue.put_nowait, (handle.index, Finished(done)))

    def abort(self, request_ids: list[str]) -> None:
        pass

    def counts(self) -> dict[str, int]:
        return {}


async def call(app, body: bytes) -> int:
    """One POST /v1/completions through ASGI; the response status."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"localhost")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    gone = asyncio.Event()

    async def receive():
        if messages:
            return messages.pop()
        await gone.wait()  # the disconnect watcher waits here until the answer is sent
        return {"type": "http.disconnect"}

    status = 0

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif not message.get("more_body", False):
            gone.set()

    await app(scope, receive, send)
    return status


async def run(args) -> dict:
    rng = np.random.default_rng(0)
    rows = rng.integers(
        0, args.experts, size=(args.prompt_len + args.output_len - 1, args.moe_layers, args.top_k)
    ).astype(np.uint8)
    loop = StubLoop(rows, args.output_len)
    ctx = ServingContext(
        loop=loop,  # type: ignore[arg-type]
        tokenizer=None,
        model=ModelFacts(
            args.moe_layers, list(range(args.moe_layers)), args.experts, args.top_k, 50_000
        ),
        served_model_names=["bench"],
        model_path="bench",
        max_model_len=4096,
        num_kv_blocks=1 << 20,
        block_size=16,
        return_routed_experts=True,
    )
    app = create_app(ctx)
    freeze_start_up_heap()  # as the server does before it listens
    bodies = [
        json.dumps(
            {
                "prompt": rng.integers(100, 40_000, args.prompt_len).tolist(),
                "max_tokens": args.output_len,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        for _ in range(args.concurrency)
    ]
    for body in bodies:  # warm-up: first calls build caches (pydantic, routes)
        assert await call(app, body) == 200
    cpu, wall = time.process_time(), time.perf_counter()
    done = 0
    while done < args.requests:
        batch = min(args.concurrency, args.requests - done)
        statuses = await asyncio.gather(*(call(app, bodies[i]) for i in range(batch)))
        assert all(s == 200 for s in statuses), statuses
        done += batch
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "requests": done,
        "cpu_ms_per_request": cpu / done * 1e3,
        "wall_ms_per_request": wall / done * 1e3,
        "routed_experts_shape": list(rows.shape),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--moe-layers", type=int, default=16, help="OLMoE-1B-7B: 16")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = [asyncio.run(run(args)) for _ in range(args.repeats)]
    best = min(results, key=lambda r: r["cpu_ms_per_request"])
    print(
        json.dumps(
            {**best, "cpu_ms_each_repeat": [round(r["cpu_ms_per_request"], 3) for r in results]}
        )
    )


if __name__ == "__main__":
    main()
