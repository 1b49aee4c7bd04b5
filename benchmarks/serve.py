"""``moetrace serve`` under load, beside ``moetrace record`` on the same prompts.

In the spirit of vLLM's serving benchmark: every request at once (as ``record`` has
every prompt), N concurrent clients (closed loop) or a Poisson request rate, over real HTTP on loopback, each asking
``/v1/completions`` for ``--output-len`` tokens (EOS ignored, greedy) with the
routed experts returned.  Reports output tokens/s, TTFT (with ``--stream``),
latency p50/p99, and the server's time spent encoding routed experts per
request (the ``x-routed-experts-encode-ms`` header).  Then, in a fresh
process, ``record`` (the same ``Recording`` that ``moetrace record`` runs)
records the same prompts, and the two throughputs are compared.

Weights are random (``dummy``) in the shape of ``benchmarks/configs/NAME.json``;
both engines get the same KV cache size and batch limits, and both run one
unmeasured warm-up pass over the prompts first (Triton compiles on first use).

    python benchmarks/serve.py --config olmoe-1b-7b --num-prompts 2048

Needs starlette, uvicorn, pybase64 (server) and httpx (client); no network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

CONFIGS = Path(__file__).parent / "configs"
sys.path.insert(0, str(Path(__file__).parent))
import serve_timeline as timeline  # noqa: E402


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(count, length)).tolist()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ------------------------------------------------------------------------------ record


def _time_steps(steps: list[tuple]) -> None:
    """Wrap ``LLMEngine.step`` so each call appends the columns ``timeline.summarise`` reads."""
    from moetrace.engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def timed(self):
        counts = len(self.scheduler.running), len(self.scheduler.waiting)
        start, cpu = time.monotonic(), time.thread_time()
        finished = step(self)
        steps.append((start, time.monotonic(), time.thread_time() - cpu, *counts, len(finished)))
        return finished

    LLMEngine.step = timed  # type: ignore[method-assign]


def _record_worker(model_dir: str, prompts: list[list[int]], args: dict, queue) -> None:
    """One process: a warm-up recording, then the measured one (what ``record`` runs)."""
    from moetrace.config import EngineConfig
    from moetrace.runs.recording import Recording, SamplingDefaults
    from moetrace.runs.setup import RunOptions

    steps: list[tuple] = []
    _time_steps(steps)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
        results = []
        for tokens, name in ((args["warmup_tokens"], "warmup"), (args["output_len"], "measured")):
            engine = EngineConfig(
                num_kv_blocks=args["num_kv_blocks"],
                max_num_seqs=args["max_num_seqs"],
                max_num_batched_tokens=args["max_num_batched_tokens"],
                enable_prefix_caching=False,
                enforce_eager=args["enforce_eager"],
            )
            recording = Recording(
                RunOptions.of(model_dir, engine=engine, dtype=args["dtype"], load_format="dummy"),
                str(path),
                Path(tmp) / f"{name}.h5",
                sampling=SamplingDefaults(max_tokens=tokens, ignore_eos=True),
            )
            steps.clear()
            result = recording.run()
            results.append(
                {
                    "output_tokens": result.output_tokens,
                    "seconds": result.elapsed_s,
                    "steps": timeline.record_steps(steps),
                }
            )
    queue.put(results[-1])


def bench_record(model_dir: str, prompts, args) -> dict:
    ctx = multiprocessing.get_context("spawn")  # a fresh process: no GPU memory shared
    queue = ctx.Queue()
    proc = ctx.Process(target=_record_worker, args=(model_dir, prompts, vars(args), queue))
    proc.start()
    result = queue.get()
    proc.join()
    result["tok_s"] = result["output_tokens"] / result["seconds"]
    print(f"record: {result['tok_s']:,.0f} output tok/s ({result['seconds']:.2f} s)", flush=True)
    print(timeline.describe_record(result["steps"]), flush=True)
    return result


# ------------------------------------------------------------------------------- serve


class Server:
    def __init__(self, model_dir: str, args, trace: Path | None, timeline_out: Path) -> None:
        cmd = [
            sys.executable, "-m", "moetrace", "serve", model_dir,
            "--port", "0", "--load-format", "dummy", "--dtype", args.dtype,
            "--num-kv-blocks", str(args.num_kv_blocks),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--no-enable-prefix-caching", "--generation-config", "vllm",
        ]  # fmt: skip
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if args.engine_in_process:
            cmd.append("--engine-in-process")
        if not args.no_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if trace is not None:
            cmd += ["--trace-out", str(trace)]
        env = {**os.environ, "MOETRACE_SERVE_TIMELINE": str(timeline_out)}
        if args.switch_interval_ms is not None:
            env["MOETRACE_SERVE_SWITCH_INTERVAL_MS"] = str(args.switch_interval_ms)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:  # type: ignore[union-attr]
                sys.stderr.write("[serve] " + line)
                match = re.search(r"serving .* at (http://\S+)", line)
                if match:
                    self.url = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(1.0):
            if self.proc.poll() is not None:
                raise SystemExit("moetrace serve exited before it listened")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


async def _one(http, url: str, prompt: list[int], args, record: dict) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": args.stream,
    }
    record["sent"] = time.monotonic()
    start = time.perf_counter()
    if args.stream:
        first = None
        tokens = 0
        async with http.stream("POST", url, json=body) as r:
            r.raise_for_status()
            encode_ms = float("nan")  # headers leave before the routed experts are encoded
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter()
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("finish_reason"):
                    record["routed_experts"] = choice.get("routed_experts")
            tokens = args.output_len
        record["ttft"] = (first or time.perf_counter()) - start
    else:
        r = await http.post(url, json=body)
        r.raise_for_status()
        out = r.json()
        tokens = out["usage"]["completion_tokens"]
        encode_ms = float(r.headers.get("x-routed-experts-encode-ms", "nan"))
        record["routed_experts"] = out["choices"][0]["routed_experts"]
    record["latency"] = time.perf_counter() - start
    record["done"] = time.monotonic()
    record["tokens"] = tokens
    record["encode_ms"] = encode_ms


def open_clients(count: int) -> list:
    """One httpx client per connection: one shared pool of N connections costs O(N) per
    request (httpcore scans every connection), 15 ms of client CPU per request at N = 512
    on the 2-core CI machine, which made the client the bottleneck."""
    import ssl

    import httpx

    tls = ssl.create_default_context()  # made once: a client per connection would load it N times
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return [httpx.AsyncClient(timeout=None, limits=limits, verify=tls) for _ in range(count)]


async def drive(clients: list, url: str, prompts, args, *, measure: bool) -> dict:
    endpoint = url + "/v1/completions"
    records: list[dict] = [{} for _ in prompts]
    rng = random.Random(getattr(args, "client_index", 0))  # each client process its own arrivals
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    idle: asyncio.Queue = asyncio.Queue()  # the clients not sending a request now
    for http in clients[: args.concurrency]:
        idle.put_nowait(http)

    async def worker(http) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await _one(http, endpoint, prompts[i], args, records[i])

    window_start, client_cpu = time.monotonic(), time.process_time()
    if args.request_rate == float("inf"):
        await asyncio.gather(*(worker(http) for http in clients[: args.concurrency]))
    else:

        async def limited(i: int) -> None:
            http = await idle.get()
            try:
                await _one(http, endpoint, prompts[i], args, records[i])
            finally:
                idle.put_nowait(http)

        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.ensure_future(limited(i)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    window_end, client_cpu = time.monotonic(), time.process_time() - client_cpu
    if not measure:
        return {}
    fields = ("sent", "done", "tokens", "latency", "encode_ms", "ttft")
    return {
        "records": [{k: r[k] for k in fields if k in r} for r in records],
        "sample_shape": _check_sample(records[0].get("routed_experts"), prompts[0], args),
        "window": (window_start, window_end),
        "client_cpu_s": client_cpu,
    }


def _check_sample(encoded: str | None, prompt: list[int], args) -> list[int] | None:
    """Decode one answer's routed experts as vLLM's clients do, and check its row count."""
    if encoded is None:
        return None
    import base64
    import io

    rows = np.load(io.BytesIO(base64.b64decode(encoded)))
    assert rows.shape[0] == len(prompt) + args.output_len - 1, rows.shape
    return list(rows.shape)


async def warm_and_measure(url: str, prompts, args, barrier=None) -> dict:
    """A warm-up pass, then the measured one, over the same open connections.

    ``barrier`` (client processes): every process has warmed up before any measures.
    """
    clients = open_clients(args.concurrency)
    try:
        warm = argparse.Namespace(**{**vars(args), "output_len": args.warmup_tokens})
        await drive(clients, url, prompts, warm, measure=False)
        if barrier is not None:
            barrier.wait()  # blocks this loop on purpose: nothing of it runs yet
        return await drive(clients, url, prompts, args, measure=True)
    finally:
        await asyncio.gather(*(http.aclose() for http in clients))


def _client_worker(url: str, prompts, args: dict, barrier, queue) -> None:
    """One client process: its share of the prompts, connections and request rate."""
    try:
        result = asyncio.run(warm_and_measure(url, prompts, argparse.Namespace(**args), barrier))
    except BaseException as exc:  # the parent must not wait for a result that never comes
        barrier.abort()
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        raise
    queue.put(result)


def _shares(count: int, parts: int) -> list[list[int]]:
    """Indices 0..count-1 dealt round-robin into ``parts`` hands (none empty)."""
    parts = max(1, min(parts, count))
    return [list(range(i, count, parts)) for i in range(parts)]


def drive_processes(url: str, prompts, args) -> dict:
    """The client as ``--client-processes`` processes, each with its own event loop.

    One asyncio client sending N requests at once walks all N through each
    stage of its HTTP stack before the first request's bytes leave (a
    convoy: with httpx, 512 requests reached the server 0.5 s after the first
    was started), so the server would be measured waiting for the client.
    Several processes, as several rollout workers would be, each send a share.
    Their measured passes start together (a barrier after every warm-up); the
    window runs from the first start to the last answer (one monotonic clock).
    """
    hands = _shares(len(prompts), args.client_processes)
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(len(hands)), ctx.Queue()
    procs = []
    for i, hand in enumerate(hands):
        share = {
            **vars(args),
            "out": None,
            "client_index": i,
            "concurrency": len(_shares(args.concurrency, len(hands))[i]) or 1,
            "request_rate": args.request_rate / len(hands),
        }
        proc = ctx.Process(
            target=_client_worker,
            args=(url, [prompts[j] for j in hand], share, barrier, queue),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    parts = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    failed = [p["error"] for p in parts if "error" in p]
    if failed:
        raise SystemExit(f"a client process failed: {failed[0]}")
    return _merge(parts, args)


def _merge(parts: list[dict], args) -> dict:
    """The client processes' figures as one client's, over the union of their windows."""
    window = (min(p["window"][0] for p in parts), max(p["window"][1] for p in parts))
    seconds = window[1] - window[0]
    records = [r for p in parts for r in p["records"]]
    tokens = sum(r["tokens"] for r in records)
    latency = [r["latency"] for r in records]
    timed = [r for r in records if np.isfinite(r["encode_ms"])]
    encode = [r["encode_ms"] for r in timed]
    share = [r["encode_ms"] / 1e3 / r["latency"] for r in timed]
    result = {
        "seconds": seconds,
        "output_tokens": tokens,
        "tok_s": tokens / seconds,
        "requests_s": len(records) / seconds,
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
        "encode_ms_mean": statistics.fmean(encode) if encode else float("nan"),
        "encode_ms_p99": percentile(encode, 99),
        "encode_share_of_request_mean": statistics.fmean(share) if share else float("nan"),
        "client_processes": len(parts),
    }
    if args.stream:
        ttft = [r["ttft"] for r in records]
        result.update(ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99))
    result["sample_shape"] = parts[0]["sample_shape"]
    result["window"] = window
    result["client"] = [(r["sent"], r["done"]) for r in records]
    result["client_cpu_s"] = sum(p["client_cpu_s"] for p in parts)
    return result


def bench_serve(model_dir: str, prompts, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "served.h5" if args.trace_out else None
        timeline_out = Path(tmp) / "timeline.json"
        server = Server(model_dir, args, trace, timeline_out)
        try:
            result = drive_processes(server.url, prompts, args)
        finally:
            server.stop()
        raw = json.loads(timeline_out.read_text())
    if args.out:
        args.out.with_suffix(".timeline.json").write_text(json.dumps(raw))
    window, client = result.pop("window"), result.pop("client")
    result["timeline"] = timeline.summarise_serve(raw, window, client, result["client_cpu_s"])
    print(
        f"serve: {result['tok_s']:,.0f} output tok/s, latency p50 {result['latency_p50_s']:.2f} s "
        f"p99 {result['latency_p99_s']:.2f} s, encode {result['encode_ms_mean']:.3f} ms/request "
        f"({100 * result['encode_share_of_request_mean']:.3f}% of its time)"
        + (f", TTFT p50 {result['ttft_p50_s']:.3f} s" if args.stream else "")
        + f"; {result['client_processes']} client process(es)",
        flush=True,
    )
    print(timeline.describe_serve(result["timeline"]), flush=True)
    return result


def one_gil_bound(record_s: float, serve_timeline: dict) -> float:
    """serve/record at best when the engine thread and the event loop never run at once.

    ``record`` is almost all engine-thread CPU (its steps are CPU-bound on the
    host: the launches), and the event loop's CPU is HTTP work that needs the
    GIL too; under one GIL the two add up, however well they take turns.
    """
    loop_cpu = serve_timeline.get("event_loop_cpu_s", float("nan"))
    return record_s / (record_s + loop_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="olmoe-1b-7b", help="name under benchmarks/configs")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: all at once, as record has every prompt)",
    )
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="requests/s (Poisson arrivals); inf: closed loop of --concurrency clients",
    )  # fmt: skip
    parser.add_argument("--stream", action="store_true", help="stream (gives TTFT)")
    parser.add_argument(
        "--client-processes", type=int, default=8,
        help="client processes sharing the prompts, connections and rate (one asyncio "
        "client sending hundreds of requests at once delays its own requests)",
    )  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--warmup-tokens", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--engine-in-process", action="store_true",
        help="serve with the engine in a thread of the HTTP process (the one-GIL layout; "
        "default: the server's default, an engine process of its own)",
    )  # fmt: skip
    parser.add_argument("--no-routed-experts", action="store_true", help="serve without them")
    parser.add_argument("--trace-out", action="store_true", help="serve with --trace-out too")
    parser.add_argument("--modes", default="serve,record", help="serve, record or both")
    parser.add_argument(
        "--switch-interval-ms", type=float, default=None,
        help="the server's thread switch interval (MOETRACE_SERVE_SWITCH_INTERVAL_MS); "
        "default: the server's own",
    )  # fmt: skip
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    import torch

    args.concurrency = args.concurrency or args.num_prompts
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    prompts = random_prompts(args.num_prompts, args.prompt_len, config["vocab_size"], seed=0)
    tokens_per_seq = args.prompt_len + args.output_len
    args.num_kv_blocks = args.max_num_seqs * -(-tokens_per_seq // 16) + 64
    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke test)",
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(f"# {env['gpu']}, torch {env['torch']}, {args.config}", flush=True)
    results: dict = {"env": env}
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        for mode in [m for m in args.modes.split(",") if m]:
            results[mode] = (bench_serve if mode == "serve" else bench_record)(
                model_dir, prompts, args
            )
    if "serve" in results and "record" in results:
        ratio = results["serve"]["tok_s"] / results["record"]["tok_s"]
        results["serve_over_record"] = ratio
        print(f"serve / record: {ratio:.3f}", flush=True)
        bound = one_gil_bound(results["record"]["seconds"], results["serve"]["timeline"])
        results["one_gil_bound"] = bound
        print(
            f"one-GIL bound: {bound:.3f} (record's time over record's time plus the event loop's "
            "CPU: what serve reaches at best while engine and HTTP share one GIL, i.e. with "
            f"--engine-in-process{'' if args.engine_in_process else '; this run had a process each'})",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
