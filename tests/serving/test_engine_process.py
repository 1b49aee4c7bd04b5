"""``moetrace serve``'s engine process: its death, the server's signals, and the fallback.

The engine steps in a spawned child (moetrace/serving/engine_process.py). A
child that dies (killed here with SIGKILL, as the out-of-memory killer does)
must fail the requests in flight with an OpenAI-style 500, leave the trace
readable and stop the server with an error, never hang it; Ctrl-C (to the
whole process group, as a terminal sends it) or SIGTERM must stop both
processes and leave none behind; ``--engine-in-process`` must serve the same
answers from a thread.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.serve import (
    DEMO_MOE_LAYERS,
    ServerProcess,
    descendants,
    engine_process,
    gone,
    record_demo,
    vllm_decode,
)

from moetrace import open_trace

LONG = {"prompt": "still running", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


def _wait_running(srv: ServerProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.metrics()["num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def test_a_killed_engine_fails_requests_with_500_and_stops_the_server(tmp_path):
    trace = tmp_path / "t.h5"
    srv = ServerProcess(
        "demo",
        "--device",
        "cpu",
        "--engine-process",
        "--enable-return-routed-experts",
        "--trace-out",
        str(trace),
    )
    try:
        done = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "served first", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert done.status_code == 200
        answer: dict = {}

        def long_request() -> None:
            r = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=120)
            answer["status"], answer["body"] = r.status_code, r.json()

        client = threading.Thread(target=long_request)
        client.start()
        _wait_running(srv)
        child = engine_process(srv.proc.pid)
        os.kill(child, signal.SIGKILL)
        client.join(60)
        assert not client.is_alive(), "the request in flight hung"
        code = srv.proc.wait(60)  # the server stops by itself
    finally:
        srv.stop()
    assert answer["status"] == 500, answer
    message = answer["body"]["error"]["message"]
    assert f"the engine process (pid {child}) was killed by SIGKILL" in message, message
    assert code == 1, srv.stderr
    assert "Traceback" not in srv.stderr, srv.stderr
    last = srv.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "was killed by SIGKILL" in last, srv.stderr
    with open_trace(trace) as t:  # closed intact: the request served before the kill is there
        assert [r.output_len for r in t] == [4]


def test_an_engine_killed_while_idle_stops_the_server():
    srv = ServerProcess("demo", "--device", "cpu", "--engine-process")
    try:
        child = engine_process(srv.proc.pid)
        os.kill(child, signal.SIGKILL)
        code = srv.proc.wait(30)
    finally:
        srv.stop()
    assert code == 1, srv.stderr
    assert "was killed by SIGKILL" in srv.stderr.strip().splitlines()[-1], srv.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_group_stops_both_processes_and_leaves_none(sig):
    srv = ServerProcess(
        "demo",
        "--device",
        "cpu",
        "--engine-process",
        "--shutdown-timeout",
        "0.5",
        start_new_session=True,
    )
    try:
        below = descendants(srv.proc.pid)
        child = engine_process(srv.proc.pid)
        assert child in below
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}) as r:
            next(r.iter_lines())  # a request in flight when the signal comes
            os.killpg(srv.proc.pid, sig)  # what a terminal's Ctrl-C does: every process of it
            code = srv.proc.wait(60)
    finally:
        srv.stop()
    assert code == 0, srv.stderr
    assert f"stopped by {signal.Signals(sig).name}: served 0 requests" in srv.stderr, srv.stderr
    assert "1 aborted" in srv.stderr and "Traceback" not in srv.stderr, srv.stderr
    assert gone([srv.proc.pid, *below]), "a process of the server outlived it"


@pytest.mark.parametrize(
    "layout, spawns", [(["--engine-in-process"], False), ([], True)], ids=["thread", "default"]
)
def test_both_layouts_serve_what_record_writes(tmp_path, layout, spawns):
    """The engine process is the default (measured on the H200: 0.97-0.98x of record);
    ``--engine-in-process`` keeps the engine in a thread of the HTTP process."""
    prompt = "the experts route this token"
    recorded = record_demo(tmp_path, [{"id": "p", "prompt": prompt}], 8)["p"]
    srv = ServerProcess("demo", "--device", "cpu", "--enable-return-routed-experts", *layout)
    try:
        spawned = any(
            b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            for pid in descendants(srv.proc.pid)
        )
        assert spawned == spawns, f"{layout or 'the default'}: engine process {spawned}"
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        choice = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    finally:
        assert srv.stop() == 0, srv.stderr
    assert choice["token_ids"] == recorded["output"]
    rows = vllm_decode(choice["routed_experts"])[:, DEMO_MOE_LAYERS]
    np.testing.assert_array_equal(rows, recorded["rows"])


def test_the_engine_process_may_start_processes_of_its_own():
    """On CUDA the engine forks Triton's compile workers while it loads; a daemonic
    process may not have children, and the first H200 start failed on exactly that."""
    from moetrace.config import EngineConfig
    from moetrace.models.source import resolve_model
    from moetrace.serving.engine_process import EngineSpec
    from moetrace.serving.remote_engine import RemoteEngine

    spec = EngineSpec(
        model=resolve_model("demo"),
        device="cpu",
        dtype="auto",
        load_format="auto",
        engine_config=EngineConfig(num_kv_blocks=16),
        metadata=False,
        timeline=False,
        switch_interval_s=0.005,
    )
    engine = RemoteEngine(spec)
    try:
        assert engine.ready.num_blocks == 16
        assert not engine._proc.daemon
    finally:
        engine.close()
    assert gone([engine._proc.pid]), "the engine process outlived close()"
