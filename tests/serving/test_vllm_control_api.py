"""vLLM's trainer routes and prime-rl's, in the call sequences prime-rl, SkyRL and TRL make.

One server per module, the engine in the HTTP process (``--engine-in-process``:
the other layout than test_weights_api.py's). prime-rl pauses with
``mode=keep``, loads a checkpoint directory through ``/update_weights
{weight_dir}`` and resumes, then generates on ``/inference/v1/generate``,
whose routed experts are decoded as verifiers decodes them. SkyRL's and
TRL's native transfer joins the trainer's group and receives vLLM's packed
buffers. References: ``moetrace record`` of each checkpoint.
"""

from __future__ import annotations

import binascii
import time

import httpx
import numpy as np
import pytest
from support.checkpoints import (
    DEMO_MOE_LAYERS,
    PROMPTS,
    changed_demo,
    engine_for,
    load_tensors,
    run,
)
from support.serve import ServerProcess, in_thread, post, record_probes, vllm_decode, wait_running
from support.trainer import Trainer, specs_of

MAX_NEW = 8
LONG = 160  # a request still running when the pause comes
PROBES = PROMPTS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {"v1": changed_demo(root / "v1", shift=3, scale=1.5), "v2": changed_demo(root / "v2", 7)}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, checkpoints):
    return record_probes(tmp_path_factory.mktemp("recorded"), checkpoints, PROBES, MAX_NEW)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "demo", "--device", "cpu", "--engine-in-process", "--enable-weight-updates",
        "--enable-return-routed-experts", "--num-kv-blocks", "256",
        "--weight-update-timeout", "5",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.stderr


def tokens_generate(srv, ids, max_tokens=MAX_NEW, **sampling) -> dict:
    """SkyRL's and verifiers' call: vLLM's /inference/v1/generate."""
    body = {"token_ids": ids, "sampling_params": {"max_tokens": max_tokens, "temperature": 0,
            **sampling}, "model": "demo", "cache_salt": "policy-v"}  # fmt: skip
    answer = post(srv, "/inference/v1/generate", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def verifiers_rows(payload: dict, path_len: int) -> np.ndarray:
    """verifiers' decoding (v1/graph.py): raw bytes by dtype and shape, offset by start."""
    raw = binascii.a2b_base64(payload["data"])
    arr = np.frombuffer(raw, dtype=np.dtype(payload.get("dtype", "uint8"))).reshape(
        payload["shape"]
    )
    off = path_len - int(payload.get("start", 0) or 0)
    return arr[off:]


def assert_tokens_route(srv, want: dict) -> None:
    for rid, ids in PROBES.items():
        choice = tokens_generate(srv, ids)["choices"][0]
        assert choice["token_ids"] == want[rid]["output"], rid
        rows = verifiers_rows(choice["routed_experts"], 0)[:, list(DEMO_MOE_LAYERS)]
        np.testing.assert_array_equal(rows, want[rid]["rows"])


def test_prime_rl_pause_update_resume(server, checkpoints, recorded):
    """prime-rl's update_weights (utils/client.py): /pause?mode=keep&clear_cache=false, the
    NCCL_READY marker, /update_weights {weight_dir}, then /resume in a finally."""
    prompt = PROBES["hello"]
    thread, out = in_thread(lambda: tokens_generate(server, prompt, LONG, ignore_eos=True))
    wait_running(server)
    paused = post(server, "/pause", params={"mode": "keep", "clear_cache": "false"})
    assert paused.json() == {"status": "paused"}
    assert httpx.get(server.url + "/is_paused", timeout=30).json() == {"is_paused": True}
    (checkpoints["v1"] / "NCCL_READY").touch()
    updated = post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    assert updated.status_code == 200 and updated.json() == {"status": "ok"}, updated.text
    assert post(server, "/resume").json() == {"status": "resumed"}
    thread.join(60)
    kept = out["answer"]["choices"][0]
    assert kept["finish_reason"] == "length" and len(kept["token_ids"]) == LONG
    assert httpx.get(server.url + "/liveness", timeout=30).json() == {"status": "ok"}
    assert_tokens_route(server, recorded["v1"])


def test_verifiers_offsets_a_later_turn_by_start(server, checkpoints, recorded):
    post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    ids = PROBES["code"]
    full = recorded["v1"]["code"]
    start = len(ids) - 2
    choice = tokens_generate(server, ids, routed_experts_prompt_start=start)["choices"][0]
    payload = choice["routed_experts"]
    assert payload["start"] == start and payload["dtype"] == "uint8"
    rows = verifiers_rows(payload, start)[:, list(DEMO_MOE_LAYERS)]
    np.testing.assert_array_equal(rows, full["rows"][start:])
    at_end = tokens_generate(server, ids, routed_experts_prompt_start=len(ids))["choices"][0]
    assert at_end["routed_experts"]["shape"][0] == MAX_NEW - 1  # the output's rows only


def test_skyrl_native_transfer_packed(server, checkpoints, recorded):
    """SkyRL's non-colocated sync: world size from the server, the group (rank_offset 1),
    pause keep, start, update_weights packed beside the trainer's packed broadcasts,
    finish with a weight version, resume."""
    world = httpx.get(server.url + "/get_world_size", timeout=30).json()["world_size"]
    trainer = Trainer(checkpoints["v2"], world_size=world + 1)
    try:
        info = {**trainer.init_payload(), "backend": "gloo"}
        del info["group_name"]
        joined = post(server, "/init_weight_transfer_engine", {"init_info": info})
        assert joined.json() == {"message": "Weight transfer initialized"}, joined.text
        trainer.expect("joined")
        assert post(server, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        started = post(server, "/start_weight_update", {"is_checkpoint_format": True})
        assert started.json() == {"message": "Weight update started"}
        specs = specs_of(load_tensors(checkpoints["v2"]))
        buffer = 1 << 20
        update = {
            "names": [s[0] for s in specs],
            "dtype_names": [s[1] for s in specs],
            "shapes": [s[2] for s in specs],
            "packed": True,
            "packed_buffer_size_bytes": buffer,
        }
        thread, out = in_thread(lambda: post(server, "/update_weights", {"update_info": update}))
        trainer.send(specs, packed=buffer)
        thread.join(60)
        assert out["answer"].json() == {"message": "Weights updated"}, out["answer"].text
        finished = post(server, "/finish_weight_update", {"weight_version": "3"})
        assert finished.json() == {"message": "Weight update finished"}
        assert post(server, "/resume").json() == {"status": "resumed"}
        assert httpx.get(server.url + "/weight_info", timeout=30).json() == {"weight_version": "3"}
        assert_tokens_route(server, recorded["v2"])
    finally:
        assert trainer.close() == 0


def test_pause_abort_answers_the_requests_in_flight(server, checkpoints):
    post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    prompt = PROBES["code"]
    body = {"prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    thread, out = in_thread(lambda: post(server, "/v1/completions", body))
    wait_running(server)
    assert post(server, "/pause", params={"mode": "abort"}).json() == {"status": "paused"}
    thread.join(30)
    assert not thread.is_alive()
    choice = out["answer"].json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    partial = choice["token_ids"]
    assert 0 < len(partial) < LONG
    rows = vllm_decode(choice["routed_experts"])[:, list(DEMO_MOE_LAYERS)]
    want = run(engine_for(str(checkpoints["v1"])), {"r": prompt}, max_tokens=len(partial))["r"]
    assert partial == want.output_token_ids.tolist()
    np.testing.assert_array_equal(rows, want.routed_experts)
    post(server, "/resume")


def test_pause_wait_lets_running_requests_finish_and_holds_new_ones(server, checkpoints):
    post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    body = {"prompt": PROBES["hello"], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    running, first = in_thread(lambda: post(server, "/v1/completions", body))
    wait_running(server)
    pausing, paused = in_thread(lambda: post(server, "/pause", params={"mode": "wait"}))
    time.sleep(0.05)
    held, late = in_thread(lambda: post(server, "/v1/completions", {**body, "max_tokens": 4}))
    running.join(60)
    pausing.join(60)
    assert first["answer"].json()["choices"][0]["finish_reason"] == "length"
    assert paused["answer"].json() == {"status": "paused"}
    time.sleep(0.2)
    assert held.is_alive()  # waits for /resume
    post(server, "/resume")
    held.join(60)
    assert late["answer"].json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up(server, checkpoints, recorded, level):
    """Colocated training: sleep frees the memory; level 2 drops the weights, so new ones
    follow the wake-up (the KV cache comes back last, as SkyRL wakes it)."""
    post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    assert post(server, "/sleep", params={"level": str(level), "mode": "abort"}).status_code == 200
    assert httpx.get(server.url + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    assert post(server, "/wake_up", params={"tags": ["weights"]}).status_code == 200
    if level == 2:
        post(server, "/update_weights", {"weight_dir": str(checkpoints["v2"])})
    assert httpx.get(server.url + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    assert post(server, "/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert httpx.get(server.url + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
    assert_tokens_route(server, recorded["v1" if level == 1 else "v2"])


def test_reset_prefix_cache_and_abort_requests(server, checkpoints):
    post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    tokens_generate(server, PROBES["code"])
    again = tokens_generate(server, PROBES["code"])
    assert again["usage"]["prompt_tokens"] == len(PROBES["code"])
    reset = post(server, "/reset_prefix_cache", {"reset_running_requests": False})
    assert reset.status_code == 200 and reset.content == b""
    answer = post(server, "/abort_requests", {})
    assert answer.json() == {"status": "aborted", "aborted": 0}


def test_a_bad_transfer_is_an_error_and_the_server_serves_on(server, checkpoints, recorded):
    post(server, "/update_weights", {"weight_dir": str(checkpoints["v1"])})
    update = {"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}}
    # A group left from an earlier test has lost its trainer: the first call fails and
    # leaves it; then there is none.
    first = post(server, "/update_weights", update)
    assert first.status_code == 400 and "unchanged" in first.json()["error"]
    missing = post(server, "/update_weights", update)
    assert missing.status_code == 400 and "no weight update group" in missing.json()["error"]
    both = post(server, "/update_weights", {"weight_dir": "x", "update_info": None})
    assert both.status_code == 400
    gone = post(server, "/update_weights", {"weight_dir": "/nonexistent"})
    assert gone.status_code == 400 and "no such model directory" in gone.json()["error"]
    assert_tokens_route(server, recorded["v1"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [1, 2], "stream": True}, "stream"),
        ({"token_ids": [1, 2], "sampling_params": {"max_token": 3}}, "sampling_params.max_token"),
        ({"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}},
         "sampling_params.routed_experts_prompt_start"),
        ({"token_ids": []}, "token_ids"),
    ],
)  # fmt: skip
def test_tokens_generate_names_a_bad_field(server, body, param):
    answer = post(server, "/inference/v1/generate", body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
