"""A real ``moetrace serve`` process on loopback, and the clients' decoding rules."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

DEMO_HIDDEN_LAYERS = 4  # the demo: 4 decoder layers, layer 0 dense, top-2 of 16 experts
DEMO_MOE_LAYERS = [1, 2, 3]
DEMO_TOP_K = 2


def vllm_decode(encoded: str) -> np.ndarray:
    """The decoding rule of vLLM's test_return_routed_experts.py."""
    return np.load(io.BytesIO(base64.b64decode(encoded)))


def sglang_decode(encoded: str, num_hidden_layers: int, top_k: int) -> np.ndarray:
    """SGLang's rule (extract_routed_experts_from_meta_info, then the reshape its users do)."""
    flat = np.frombuffer(base64.b64decode(encoded.encode("utf-8")), dtype=np.int32)
    return flat.reshape(-1, num_hidden_layers * top_k)


class ServerProcess:
    """``moetrace serve`` started as a user starts it; ``url`` once it listens."""

    def __init__(
        self,
        *args: str,
        timeout_s: float = 120.0,
        request_timeout_s: float = 60.0,
        env: dict | None = None,
        **popen,
    ) -> None:
        self.request_timeout_s = request_timeout_s  # what ``post`` waits for an answer
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moetrace", "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            **popen,
        )
        self.lines: list[str] = []
        self._url = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._url.wait(timeout_s):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            match = re.search(r"serving .* at (http://\S+)", line)
            if match:
                self.url = match.group(1)
                self._url.set()

    def wait(self, timeout_s: float = 60.0) -> int:
        """The exit code once the server ends by itself (a signal already sent), sending none."""
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(5)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """The unlabelled-by-reason samples of /metrics, read with Prometheus' own parser."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(self.url + "/metrics", timeout=10, headers=headers)
        r.raise_for_status()
        return {
            sample.name.removeprefix("moetrace:"): sample.value
            for family in text_string_to_metric_families(r.text)
            for sample in family.samples
            if set(sample.labels) == {"model_name"}
        }

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Metrics once no request runs or waits (or the last seen, after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def record_demo(
    tmp: Path,
    lines: list[dict],
    max_tokens: int,
    device: str = "cpu",
    *extra: str,
    model: str = "demo",
) -> dict[str, dict]:
    """What ``moetrace record`` of MODEL writes for ``lines`` (greedy): id -> tokens and rows."""
    import json

    from moetrace import open_trace

    tmp.mkdir(parents=True, exist_ok=True)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp / "record.h5"
    proc = subprocess.run(
        [sys.executable, "-m", "moetrace", "record", model, str(prompts), "-o", str(out)]
        + ["--max-tokens", str(max_tokens), "--quiet", "--device", device, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    with open_trace(out) as trace:
        return {
            r.id: {
                "prompt": r.prompt_token_ids.tolist(),
                "output": r.output_token_ids.tolist(),
                "rows": np.asarray(r.routed_experts),
            }
            for r in trace
        }


def record_models(
    tmp: Path, models: dict[str, str], lines: list[dict], max_tokens: int
) -> dict[str, dict[str, dict]]:
    """``record_demo`` of several models at once (each in its own process)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(models)) as pool:
        runs = {
            key: pool.submit(record_demo, tmp / key, lines, max_tokens, model=model)
            for key, model in models.items()
        }
        return {key: run.result() for key, run in runs.items()}


def record_probes(
    tmp: Path, checkpoints: dict, probes: dict[str, list[int]], max_tokens: int
) -> dict[str, dict[str, dict]]:
    """``record`` (greedy) of each checkpoint over the probe prompts: key -> id -> result."""
    lines = [{"id": r, "prompt_token_ids": ids, "temperature": 0} for r, ids in probes.items()]
    models = {key: str(path) for key, path in checkpoints.items()}
    return record_models(tmp, models, lines, max_tokens)


def post(srv: ServerProcess, path: str, body: dict | None = None, **kwargs):
    """POST ``body`` as JSON (none at all for ``None``), waiting the server's request timeout."""
    import httpx

    return httpx.post(srv.url + path, json=body, timeout=srv.request_timeout_s, **kwargs)


def in_thread(target) -> tuple[threading.Thread, dict]:
    """Run ``target`` (a blocking HTTP call) in a thread; its result lands in ``out["answer"]``."""
    out: dict = {}

    def work() -> None:
        out["answer"] = target()

    thread = threading.Thread(target=work)
    thread.start()
    return thread, out


def wait_running(srv: ServerProcess, timeout_s: float = 60.0) -> None:
    """Until a request runs (and a little longer, so it has sampled some tokens)."""
    deadline = time.monotonic() + timeout_s
    while srv.metrics()["num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc, Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def engine_process(pid: int) -> int:
    """The spawned engine process of the server ``pid``."""
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return child
    raise AssertionError(f"no engine process below {pid}")


def gone(pids: list[int], timeout_s: float = 30.0) -> bool:
    """True once none of ``pids`` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.1)
    return False
