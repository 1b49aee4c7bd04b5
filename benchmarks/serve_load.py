"""A load run against ``moetrace serve``: many clients, mixed routes, some hanging up mid-stream.

Starts a server (``--trace-out``), sends ``--requests`` requests from
``--clients`` concurrent clients (completions, chat and ``/generate``, a
third streamed, ``--disconnect`` of the streams closed after their first
chunk), samples the resident memory of the server and its engine process
every second (reported as the mean of each tenth of the run), then stops
the server with SIGTERM and checks the trace: every request answered 200 is
in it exactly once (by id), every hang-up is there as an abort or not at
all.  Prints one JSON object.

    python benchmarks/serve_load.py --model demo --device cpu --requests 2000 --clients 200
    python benchmarks/serve_load.py --model ~/models/OLMoE-1B-7B --device cuda --requests 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def by_tenth(values: list[float]) -> list[int]:
    """The mean of each tenth of the run's samples: flat, or how it grows and where it stops."""
    size = max(1, len(values) // 10)
    return [round(sum(part) / len(part)) for i in range(0, len(values), size)
            if (part := values[i:i + size])][:10]  # fmt: skip


def start(args, trace: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "moetrace", "serve", args.model, "--device", args.device,
           "--port", "0", "--trace-out", str(trace), "--shutdown-timeout", "30",
           *args.serve_args]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        match = re.search(r"serving .* at (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, match.group(1)
    raise SystemExit("the server did not start")


async def one(http: httpx.AsyncClient, i: int, args, tally: dict) -> None:
    kind = ("completion", "chat", "generate")[i % 3]
    stream = i % 3 == 0 or (i % 7 == 0 and kind != "generate")
    hang_up = stream and random.random() < args.disconnect / (1 / 3)
    rid = f"load-{i}"
    if kind == "completion":
        path, body = "/v1/completions", {"prompt": f"request {i}: " + "experts " * (i % 9),
                                         "request_id": rid}  # fmt: skip
        trace_id = f"cmpl-{rid}-0-0"
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"question {i}"}], "request_id": rid}
        trace_id = f"chatcmpl-{rid}-0-0"
    else:
        path, body = "/generate", {"text": f"generate {i}", "rid": rid}
        trace_id = rid
    if kind == "generate":
        body["sampling_params"] = {"max_new_tokens": args.max_tokens, "temperature": 0}
    else:
        body.update(max_tokens=args.max_tokens, temperature=0)
    body["stream"] = stream
    try:
        if stream:
            async with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    tally["errors"].append((r.status_code, (await r.aread())[:200].decode()))
                    return
                async for line in r.aiter_lines():
                    if hang_up:
                        tally["hung_up"].append(trace_id)
                        return
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        tally["errors"].append((200, line[:200]))
                        return
            tally["ok"].append(trace_id)
        else:
            r = await http.post(path, json=body)
            if r.status_code == 200:
                tally["ok"].append(trace_id)
            else:
                tally["errors"].append((r.status_code, r.text[:200]))
    except httpx.HTTPError as exc:
        tally["errors"].append(("exception", repr(exc)[:200]))


async def drive(url: str, args, tally: dict) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                await one(http, queue.get_nowait(), args, tally)

        await asyncio.gather(*(client() for _ in range(args.clients)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of all requests")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()
    random.seed(0)
    trace = Path(tempfile.mkdtemp()) / "load.h5"
    proc, url = start(args, trace)
    engine = children(proc.pid)
    samples: list[tuple[float, float, float]] = []
    done = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not done.wait(1.0):
            eng = sum(rss_mb(p) for p in engine) if engine else float("nan")
            samples.append((time.monotonic() - t0, rss_mb(proc.pid), eng))

    threading.Thread(target=sample, daemon=True).start()
    tally: dict = {"ok": [], "errors": [], "hung_up": []}
    t0 = time.monotonic()
    asyncio.run(drive(url, args, tally))
    elapsed = time.monotonic() - t0
    done.set()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    from moetrace import open_trace
    from moetrace.trace.verify import verify_trace

    report = verify_trace(trace)
    with open_trace(trace) as t:
        records = {r.id: r.finish_reason for r in t}
    missing = [i for i in tally["ok"] if i not in records]
    hung = [records.get(i) for i in tally["hung_up"]]
    print(json.dumps({
        "requests": args.requests, "clients": args.clients, "elapsed_s": round(elapsed, 1),
        "ok": len(tally["ok"]), "errors": len(tally["errors"]), "error_examples": tally["errors"][:5],
        "hung_up": len(tally["hung_up"]),
        "hung_up_in_trace_as": {str(k): hung.count(k) for k in set(hung)},
        "answered_missing_from_trace": len(missing), "trace_records": len(records),
        "verify": report.status, "exit_code": code,
        "rss_mb_server_by_tenth": by_tenth([s[1] for s in samples]),
        "rss_mb_engine_by_tenth": by_tenth([s[2] for s in samples]),
    }))  # fmt: skip
    os.remove(trace)


if __name__ == "__main__":
    main()
