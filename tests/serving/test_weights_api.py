"""SGLang's trainer routes on a live server, in the call sequences slime and AReaL make.

One ``moetrace serve --enable-weight-updates`` process (the engine in its own
process, the default layout) serves the module. Weights come from
checkpoint directories written like a trainer's (tests/support/checkpoints.py)
and from a real trainer process broadcasting over gloo; after each update the
routed experts of the probe prompts must equal what ``moetrace record`` of
the new checkpoint writes, row for row.  Each sequence follows the calls the
framework's code makes (read from slime's ``sglang_engine.py`` and
``update_weight_from_distributed.py``, AReaL's ``sglang_remote.py`` and
``remote_inf_engine.py``).
"""

from __future__ import annotations

import signal
import socket
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
from support.serve import (
    DEMO_HIDDEN_LAYERS,
    DEMO_TOP_K,
    ServerProcess,
    in_thread,
    post,
    record_probes,
    sglang_decode,
    wait_running,
)
from support.tensor_sender import TensorSender
from support.trainer import Trainer, distributed_update, specs_of

from moetrace import open_trace
from moetrace.models.demo import DEMO_DIR
from moetrace.trace.verify import verify_trace

MAX_NEW = 8
PROBES = PROMPTS
LONG = 160  # a request still running when the pause comes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "demo": DEMO_DIR,
        "v1": changed_demo(root / "v1", shift=3, scale=1.5),
        "v2": changed_demo(root / "v2", shift=7),
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, checkpoints):
    return record_probes(tmp_path_factory.mktemp("recorded"), checkpoints, PROBES, MAX_NEW)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("served") / "served.h5"
    srv = ServerProcess(
        "demo", "--device", "cpu", "--enable-weight-updates", "--enable-return-routed-experts",
        "--trace-out", str(trace), "--num-kv-blocks", "256", "--weight-update-timeout", "3",
    )  # fmt: skip
    srv.trace = trace
    yield srv
    assert srv.stop() == 0, srv.stderr


def generate(srv: ServerProcess, ids: list[int], max_new: int = MAX_NEW, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **extra},
        "return_routed_experts": True,
        "return_logprob": True,
    }
    answer = post(srv, "/generate", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def moe_rows(meta: dict) -> np.ndarray:
    """SGLang's decoding rule, then the MoE layers the trace keeps."""
    flat = sglang_decode(meta["routed_experts"], DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    rows = flat.reshape(-1, DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
    return rows[:, list(DEMO_MOE_LAYERS)]


def assert_serves(srv: ServerProcess, want: dict, version: str | None = None) -> None:
    """The probes' tokens and routed experts are those ``record`` wrote for ``want``."""
    for rid, ids in PROBES.items():
        out = generate(srv, ids)
        assert out["output_ids"] == want[rid]["output"], rid
        np.testing.assert_array_equal(moe_rows(out["meta_info"]), want[rid]["rows"])
        if version is not None:
            assert out["meta_info"]["weight_version"] == version


def load_from_disk(srv: ServerProcess, path, version: str) -> None:
    answer = post(
        srv, "/update_weights_from_disk", {"model_path": str(path), "weight_version": version}
    )
    assert answer.status_code == 200 and answer.json()["success"], answer.text


# ----------------------------------------------------------------------------- slime


def test_slime_disk_update_pause_flush_continue(server, checkpoints, recorded):
    """slime's disk transport: pause, flush (GET, retried until 200), update, continue."""
    load_from_disk(server, "demo", "0")  # MODEL as serve takes it: a directory, an id, demo
    assert_serves(server, recorded["demo"], "0")
    assert post(server, "/pause_generation", {}).json() == {
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 200
    answer = post(
        server,
        "/update_weights_from_disk",
        {"model_path": str(checkpoints["v1"]), "weight_version": "1"},
    )
    body = answer.json()
    assert answer.status_code == 200 and body["success"] and body["num_paused_requests"] == 0
    assert body["message"].endswith("Weight version updated to 1."), body
    assert post(server, "/continue_generation", {}).json()["status"] == "ok"
    assert httpx.get(server.url + "/get_weight_version", timeout=30).json() == {
        "weight_version": "1"
    }
    assert_serves(server, recorded["v1"], "1")


def test_slime_distributed_update_in_buckets(server, checkpoints, recorded):
    """slime's NCCL path over gloo: the trainer (rank 0) hosts the group, the server joins at
    rank_offset 1; per bucket one HTTP call beside one broadcast per tensor."""
    trainer = Trainer(checkpoints["v2"])
    try:
        joined = post(server, "/init_weights_update_group", trainer.init_payload())
        assert joined.status_code == 200 and joined.json()["success"], joined.text
        trainer.expect("joined")
        post(server, "/pause_generation", {})
        assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 200
        specs = specs_of(load_tensors(checkpoints["v2"]))
        for bucket in (specs[:100], specs[100:]):
            body = distributed_update(
                bucket, group_name=trainer.group, flush_cache=False, weight_version="2"
            )
            thread, out = in_thread(
                lambda b=body: post(server, "/update_weights_from_distributed", b)
            )
            trainer.send(bucket)
            thread.join(60)
            assert out["answer"].status_code == 200, out["answer"].text
            assert out["answer"].json()["success"]
        post(server, "/continue_generation", {})
        assert_serves(server, recorded["v2"], "2")
        left = post(server, "/destroy_weights_update_group", {"group_name": trainer.group})
        assert left.json()["success"], left.text
    finally:
        assert trainer.close() == 0


def test_a_trainer_that_never_listens_fails_the_join_in_time_and_never_stalls_the_engine(server):
    """Waiting for the trainer's store happens beside the engine: requests are served meanwhile,
    and the join fails after --weight-update-timeout (3 s here), once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    payload = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
               "world_size": 2, "backend": "gloo"}  # fmt: skip
    started = time.monotonic()
    thread, out = in_thread(lambda: post(server, "/init_weights_update_group", payload))
    probe(server)
    assert thread.is_alive(), "the probe waited for the join"
    thread.join(60)
    elapsed = time.monotonic() - started
    answer = out["answer"]
    assert answer.status_code == 400 and not answer.json()["success"], answer.text
    assert f"nobody listened at 127.0.0.1:{port}" in answer.json()["message"]
    assert 3 <= elapsed < 6, elapsed


def test_a_stop_during_a_weight_update_answers_everyone(checkpoints, tmp_path):
    """SIGTERM while a broadcast is awaited: the stop waits for the update's own timeout (8 s,
    past the 1 s drain and uvicorn's 5 s grace), then the update gets its JSON 400 and the
    request in flight its 200 abort, not uvicorn's plain-text 500s."""
    trace = tmp_path / "t.h5"
    srv = ServerProcess("demo", "--device", "cpu", "--enable-weight-updates", "--trace-out",
                        str(trace), "--weight-update-timeout", "8", "--shutdown-timeout", "1")  # fmt: skip
    trainer = Trainer(checkpoints["v2"])
    try:
        assert post(srv, "/init_weights_update_group", trainer.init_payload()).json()["success"]
        trainer.expect("joined")
        request = {"text": "go on", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
        gen, gen_out = in_thread(lambda: post(srv, "/generate", request))
        wait_running(srv)
        body = distributed_update([["model.norm.weight", "float32", [128]]])
        update, update_out = in_thread(lambda: post(srv, "/update_weights_from_distributed", body))
        time.sleep(0.5)  # the update waits for its broadcast, the request beside it
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait() == 0, srv.stderr
        update.join(30)
        gen.join(30)
    finally:
        srv.stop()
        trainer.close()
    answer = update_out["answer"]
    assert answer.status_code == 400, answer.text
    assert "broadcast from the trainer" in answer.json()["message"]
    generated = gen_out["answer"]
    assert generated.status_code == 200, generated.text
    assert generated.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert verify_trace(trace).status == "ok"
    with open_trace(trace) as t:
        assert [r.finish_reason for r in t] == ["abort"]


def test_areal_sends_the_port_as_a_string(server, checkpoints):
    trainer = Trainer(checkpoints["v2"])
    try:
        payload = {**trainer.init_payload(), "master_port": str(trainer.port)}
        joined = post(server, "/init_weights_update_group", payload)
        assert joined.status_code == 200 and joined.json()["success"], joined.text
        trainer.expect("joined")
        left = post(server, "/destroy_weights_update_group", {"group_name": trainer.group})
        assert left.json()["success"], left.text
    finally:
        assert trainer.close() == 0


# ----------------------------------------------------------------------------- AReaL


def test_areal_abort_and_resubmit_across_an_update(server, checkpoints):
    """AReaL: the pause aborts the rollout in flight, which comes back at once with its
    partial tokens and their routed experts; after the update (abort_all_requests) the
    client resubmits prompt + partial output for the tokens still wanted."""
    load_from_disk(server, checkpoints["demo"], "0")
    prompt = PROBES["code"]
    thread, out = in_thread(lambda: generate(server, prompt, LONG, ignore_eos=True))
    wait_running(server)
    paused = post(server, "/pause_generation", {})
    thread.join(30)
    assert not thread.is_alive(), "the aborted request did not come back"
    assert paused.status_code == 200
    first = out["answer"]
    meta = first["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    partial = first["output_ids"]
    assert 0 < len(partial) < LONG
    assert [t[1] for t in meta["output_token_logprobs"]] == partial
    # AReaL's reshape: (prompt_tokens + completion_tokens - 1, layers * top_k)
    rows = moe_rows(meta)
    assert rows.shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1
    reference = run(engine_for("demo"), {"r": prompt}, max_tokens=len(partial))["r"]
    assert partial == reference.output_token_ids.tolist()  # the tokens an unpaused run samples
    np.testing.assert_array_equal(rows, reference.routed_experts)

    update = {
        "model_path": str(checkpoints["v1"]),
        "abort_all_requests": True,
        "weight_version": "1",
    }
    assert post(server, "/update_weights_from_disk", update).json()["success"]
    post(server, "/continue_generation", {})
    resubmitted = prompt + partial
    second = generate(server, resubmitted, LONG - len(partial), ignore_eos=True)
    assert second["meta_info"]["finish_reason"]["type"] == "length"
    assert second["meta_info"]["weight_version"] == "1"
    want = run(engine_for(str(checkpoints["v1"])), {"r": resubmitted}, LONG - len(partial))["r"]
    assert second["output_ids"] == want.output_token_ids.tolist()
    np.testing.assert_array_equal(moe_rows(second["meta_info"]), want.routed_experts)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_kept_request_continues_to_the_unpaused_result(server, checkpoints, mode):
    load_from_disk(server, checkpoints["demo"], "0")
    prompt = PROBES["hello"]
    thread, out = in_thread(lambda: generate(server, prompt, LONG, ignore_eos=True))
    wait_running(server)
    assert post(server, "/pause_generation", {"mode": mode}).status_code == 200
    frozen = server.metrics()["engine_steps_total"]
    time.sleep(0.3)
    assert server.metrics()["engine_steps_total"] == frozen  # nothing steps while paused
    assert thread.is_alive()
    post(server, "/continue_generation", {})
    thread.join(60)
    got = out["answer"]
    want = run(engine_for("demo"), {"r": prompt}, max_tokens=LONG)["r"]
    assert got["output_ids"] == want.output_token_ids.tolist()
    np.testing.assert_array_equal(moe_rows(got["meta_info"]), want.routed_experts)


def test_flush_cache_waits_for_requests_to_leave(server, checkpoints):
    load_from_disk(server, checkpoints["demo"], "0")
    thread, _ = in_thread(lambda: generate(server, PROBES["hello"], LONG, ignore_eos=True))
    wait_running(server)
    post(server, "/pause_generation", {"mode": "in_place"})
    assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 400
    post(server, "/continue_generation", {})
    thread.join(60)
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200


@pytest.mark.parametrize("load_format", ["direct", "flattened_bucket"])
def test_slime_colocated_tensors_by_reference(server, checkpoints, recorded, load_format):
    """slime's colocated path (update_weights_from_tensor): the trainer's tensors handed over
    by reference (CPU shared-memory files here, CUDA IPC handles on a GPU)."""
    load_from_disk(server, checkpoints["demo"], "0")
    names = sorted(n for n in load_tensors(checkpoints["v2"]) if "mlp.gate." in n)
    sender = TensorSender(checkpoints["v2"], names, load_format)
    try:
        body = {
            "serialized_named_tensors": [sender.payload],
            "load_format": None if load_format == "direct" else load_format,
            "flush_cache": False,
            "weight_version": "2",
        }
        answer = post(server, "/update_weights_from_tensor", body)
        assert answer.status_code == 200 and answer.json()["success"], answer.text
    finally:
        assert sender.close() == 0
    assert_serves(server, recorded["v2"], "2")  # v2 differs from the demo in its routers only


def test_a_payload_naming_other_code_is_refused(server, checkpoints):
    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps(print)).decode()
    answer = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert answer.status_code == 400
    assert "may not name builtins.print" in answer.json()["message"]


# ----------------------------------------------------------------------------- refused


def probe(srv: ServerProcess) -> np.ndarray:
    return moe_rows(generate(srv, PROBES["code"])["meta_info"])


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (["model.layers.7.mlp.gate.weight", "float32", [16, 128]], "is not a tensor"),
        (["model.layers.1.mlp.gate.weight", "float32", [16, 64]], "shape [16, 64]"),
        (["model.layers.1.mlp.gate.weight", "int32", [16, 128]], "dtype torch.int32"),
    ],
    ids=["name", "shape", "dtype"],
)
def test_a_broadcast_the_model_cannot_take_changes_nothing(server, checkpoints, bad, words):
    load_from_disk(server, checkpoints["demo"], "0")
    before = probe(server)
    trainer = Trainer(checkpoints["v2"], group=f"bad-{words[:4]}")
    try:
        joined = post(server, "/init_weights_update_group", trainer.init_payload())
        assert joined.json()["success"], joined.text
        trainer.expect("joined")
        good = ["model.layers.2.mlp.gate.weight", "float32", [16, 128]]
        bucket = [good, bad]
        body = distributed_update(bucket, group_name=trainer.group, weight_version="broken")
        thread, out = in_thread(lambda: post(server, "/update_weights_from_distributed", body))
        trainer.send(bucket)
        thread.join(60)
        answer = out["answer"]
        assert answer.status_code == 400
        message = answer.json()["message"]
        assert answer.json()["success"] is False and words in message, message
        assert "the weights are unchanged (version '0' still serves)" in message
    finally:
        trainer.close()
    np.testing.assert_array_equal(probe(server), before)
    assert httpx.get(server.url + "/get_weight_version", timeout=30).json()["weight_version"] == "0"


def test_a_trainer_that_dies_or_never_sends_leaves_the_old_weights(server, checkpoints):
    load_from_disk(server, checkpoints["demo"], "0")
    before = probe(server)
    specs = specs_of(load_tensors(checkpoints["v2"]))[:20]
    body = distributed_update(specs)
    for how in ("dies", "silent"):
        trainer = Trainer(checkpoints["v2"])
        try:
            joined = post(server, "/init_weights_update_group", trainer.init_payload())
            assert joined.json()["success"], joined.text
            trainer.expect("joined")
            thread, out = in_thread(lambda: post(server, "/update_weights_from_distributed", body))
            if how == "dies":
                trainer.send(specs, die_after=5)
            thread.join(60)  # a silent trainer: the server's 3 s timeout
            answer = out["answer"]
            assert answer.status_code == 400, (how, answer.text)
            assert "broadcast from the trainer over group" in answer.json()["message"], how
        finally:
            trainer.close()
        np.testing.assert_array_equal(probe(server), before)
        again = post(server, "/update_weights_from_distributed", body)
        assert "no weight update group" in again.json()["message"]  # the broken group is gone


def test_a_directory_that_is_not_this_models_checkpoint_is_refused(server, checkpoints, tmp_path):
    load_from_disk(server, checkpoints["demo"], "0")
    before = probe(server)
    import json

    other = changed_demo(tmp_path / "other", shift=1)
    config = json.loads((other / "config.json").read_text())
    config["moe_intermediate_size"] = 32
    (other / "config.json").write_text(json.dumps(config))
    for path, words in ((tmp_path, "no config.json"), (other, "builds another model")):
        answer = post(server, "/update_weights_from_disk", {"model_path": str(path)})
        assert answer.status_code == 400 and words in answer.json()["message"], answer.text
    np.testing.assert_array_equal(probe(server), before)


def test_bad_bodies_are_400s_naming_the_field(server):
    answer = post(server, "/init_weights_update_group", {"master_address": "x", "master_port": 1})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "rank_offset"
    answer = post(server, "/pause_generation", {"mode": "sideways"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mode"
    answer = post(server, "/update_weights_from_disk", {"model_path": "x", "is_async": True})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "is_async"


# ----------------------------------------------------------------------------- memory


def test_released_memory_holds_requests_until_resumed(server, checkpoints, recorded):
    load_from_disk(server, checkpoints["v1"], "1")
    post(server, "/pause_generation", {})
    assert post(server, "/release_memory_occupation", {}).json() is None
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert sorted(info["released_memory"]) == ["kv_cache", "weights"]
    post(server, "/continue_generation", {})  # still held: the memory is away
    thread, out = in_thread(lambda: generate(server, PROBES["hello"]))
    time.sleep(0.3)
    assert thread.is_alive()
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).json() is None
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).json() is None
    thread.join(60)
    assert out["answer"]["output_ids"] == recorded["v1"]["hello"]["output"]
    assert_serves(server, recorded["v1"], "1")


def test_in_process_engine_traces_which_weights_sampled_each_token(checkpoints, tmp_path):
    """--engine-in-process: a request kept through an update has tokens of both versions,
    said in its answer (vLLM's weight_versions) and in the trace."""
    trace = tmp_path / "t.h5"
    srv = ServerProcess(
        "demo", "--device", "cpu", "--engine-in-process", "--enable-weight-updates",
        "--enable-return-routed-experts", "--trace-out", str(trace),
    )  # fmt: skip
    try:
        load_from_disk(srv, checkpoints["v1"], "1")
        body = {
            "prompt": PROBES["hello"],
            "max_tokens": LONG,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_weight_versions": True,
        }
        thread, out = in_thread(lambda: post(srv, "/v1/completions", body))
        wait_running(srv)
        post(srv, "/pause_generation", {"mode": "in_place"})
        load_from_disk(srv, checkpoints["v2"], "2")
        post(srv, "/continue_generation", {})
        thread.join(60)
        choice = out["answer"].json()["choices"][0]
        spans = choice["weight_versions"]
        assert [s["version"] for s in spans] == ["1", "2"], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
        assert spans[1]["end"] == len(choice["token_ids"]) == LONG
    finally:
        assert srv.stop() == 0, srv.stderr
    assert verify_trace(trace).status == "ok"  # intact through the updates and the pause
    with open_trace(trace) as t:
        (record,) = list(t)
    assert record.extra["weight_versions"] == [[s["version"], s["start"], s["end"]] for s in spans]
