"""Weight updates on a tensor-parallel server: every rank takes its slice, or none does.

One ``moetrace serve demo --tensor-parallel-size 2 --enable-weight-updates``
(rank 0 and a spawned worker, gloo on the CPU) serves the module.  After an
update by disk, by a trainer's broadcast (the trainer's ``world_size`` is 1
+ the server's 2 ranks, SGLang's rule) or by tensors (one payload per rank),
the probe prompts' tokens and routed experts must equal what ``moetrace
record --tensor-parallel-size 2`` of the new checkpoint writes.  An update
that one rank cannot take must leave every rank's weights as they were.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from safetensors.torch import save_file
from support.checkpoints import PROMPTS, changed_demo, gate_name, load_tensors
from support.serve import (
    DEMO_HIDDEN_LAYERS,
    DEMO_TOP_K,
    ServerProcess,
    in_thread,
    post,
    record_demo,
    sglang_decode,
)
from support.tensor_sender import TensorSender
from support.trainer import Trainer, distributed_update, specs_of

from moetrace.models.demo import DEMO_DIR

pytestmark = pytest.mark.slow  # a two-rank server and three two-rank records: about a minute

MAX_NEW = 8
TP = ("--tensor-parallel-size", "2")
MOE_LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    bad = root / "bad"  # v2's routers, but layer 1's cut to half its columns
    changed_demo(bad, shift=7)
    tensors = load_tensors(bad)
    tensors[gate_name(1)] = tensors[gate_name(1)][:, :64].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    return {
        "demo": DEMO_DIR,
        "v1": changed_demo(root / "v1", shift=3, scale=1.5),
        "v2": changed_demo(root / "v2", shift=7),
        "bad": bad,
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, checkpoints):
    """``record --tensor-parallel-size 2`` of each good checkpoint over the probes."""
    root = tmp_path_factory.mktemp("recorded")
    lines = [{"id": r, "prompt_token_ids": ids, "temperature": 0} for r, ids in PROMPTS.items()]
    out = {
        key: record_demo(root / key, lines, MAX_NEW, "cpu", *TP, model=str(checkpoints[key]))
        for key in ("demo", "v1", "v2")
    }
    for key in ("v1", "v2"):  # else an update that changed nothing would pass
        assert not np.array_equal(out[key]["code"]["rows"], out["demo"]["code"]["rows"]), key
    return out


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "demo", "--device", "cpu", *TP, "--enable-weight-updates",
        "--enable-return-routed-experts", "--num-kv-blocks", "256", "--weight-update-timeout", "5",
        timeout_s=300, request_timeout_s=120,
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.stderr


def assert_serves(srv: ServerProcess, want: dict, version: str) -> None:
    """The probes' tokens and routed experts are those ``record`` wrote for ``want``."""
    for rid, ids in PROMPTS.items():
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "return_routed_experts": True,
        }
        answer = post(srv, "/generate", body)
        assert answer.status_code == 200, answer.text
        out = answer.json()
        assert out["output_ids"] == want[rid]["output"], rid
        flat = sglang_decode(out["meta_info"]["routed_experts"], DEMO_HIDDEN_LAYERS, DEMO_TOP_K)
        rows = flat.reshape(-1, DEMO_HIDDEN_LAYERS, DEMO_TOP_K)[:, MOE_LAYERS]
        np.testing.assert_array_equal(rows, want[rid]["rows"])
        assert out["meta_info"]["weight_version"] == version


def load_from_disk(srv: ServerProcess, path, version: str) -> None:
    answer = post(
        srv, "/update_weights_from_disk", {"model_path": str(path), "weight_version": version}
    )
    assert answer.status_code == 200 and answer.json()["success"], answer.text


def test_the_server_says_it_has_two_ranks(server):
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2
    assert httpx.get(server.url + "/get_world_size", timeout=30).json() == {"world_size": 2}


def test_a_disk_update_reaches_every_rank(server, checkpoints, recorded):
    assert_serves(server, recorded["demo"], "default")
    load_from_disk(server, checkpoints["v1"], "1")
    assert_serves(server, recorded["v1"], "1")


def test_a_broadcast_reaches_every_rank(server, checkpoints, recorded):
    """slime's path: both server ranks join the trainer's group (ranks 1 and 2 of 3) and
    receive every tensor whole; each keeps its slice."""
    load_from_disk(server, checkpoints["demo"], "0")
    trainer = Trainer(checkpoints["v2"], world_size=3)
    try:
        joined = post(server, "/init_weights_update_group", trainer.init_payload())
        assert joined.status_code == 200 and joined.json()["success"], joined.text
        assert "as ranks 1-2 of 3" in joined.json()["message"]
        trainer.expect("joined")
        specs = specs_of(load_tensors(checkpoints["v2"]))
        for bucket in (specs[:100], specs[100:]):
            body = distributed_update(bucket, group_name=trainer.group, weight_version="2")
            thread, out = in_thread(
                lambda b=body: post(server, "/update_weights_from_distributed", b)
            )
            trainer.send(bucket)
            thread.join(120)
            assert out["answer"].status_code == 200, out["answer"].text
        assert_serves(server, recorded["v2"], "2")
        left = post(server, "/destroy_weights_update_group", {"group_name": trainer.group})
        assert left.json()["success"], left.text
    finally:
        assert trainer.close() == 0


def test_a_world_size_without_room_for_every_rank_is_refused(server, checkpoints):
    trainer = Trainer(checkpoints["v2"], world_size=2, group="too-small")
    try:
        answer = post(server, "/init_weights_update_group", trainer.init_payload())
        assert answer.status_code == 400, answer.text
        assert "the trainer's world_size is 1 + every server rank" in answer.json()["message"]
    finally:
        trainer.proc.kill()
        trainer.proc.wait(30)


def test_a_broadcast_the_model_cannot_take_changes_no_rank(server, checkpoints, recorded):
    """A good tensor sent before a mis-shaped one: neither is copied, on either rank."""
    load_from_disk(server, checkpoints["demo"], "0")
    trainer = Trainer(checkpoints["v2"], world_size=3, group="bad-shape")
    try:
        assert post(server, "/init_weights_update_group", trainer.init_payload()).json()["success"]
        trainer.expect("joined")
        bucket = [
            ["model.layers.2.mlp.gate.weight", "float32", [16, 128]],
            ["model.layers.1.mlp.gate.weight", "float32", [16, 64]],
        ]
        body = distributed_update(bucket, group_name=trainer.group, weight_version="broken")
        thread, out = in_thread(lambda: post(server, "/update_weights_from_distributed", body))
        trainer.send(bucket)
        thread.join(120)
        answer = out["answer"]
        assert answer.status_code == 400, answer.text
        message = answer.json()["message"]
        assert "shape [16, 64]" in message and "the weights are unchanged" in message, message
    finally:
        trainer.close()
    assert_serves(server, recorded["demo"], "0")


def test_a_trainer_that_dies_mid_update_leaves_old_weights_and_no_group(
    server, checkpoints, recorded
):
    load_from_disk(server, checkpoints["demo"], "0")
    specs = specs_of(load_tensors(checkpoints["v2"]))[:20]
    body = distributed_update(specs, group_name="dies")
    trainer = Trainer(checkpoints["v2"], world_size=3, group="dies")
    try:
        assert post(server, "/init_weights_update_group", trainer.init_payload()).json()["success"]
        trainer.expect("joined")
        thread, out = in_thread(lambda: post(server, "/update_weights_from_distributed", body))
        trainer.send(specs, die_after=5)
        thread.join(120)
        answer = out["answer"]
        assert answer.status_code == 400, answer.text
        assert "broadcast from the trainer over group" in answer.json()["message"]
    finally:
        trainer.close()
    assert_serves(server, recorded["demo"], "0")
    again = post(server, "/update_weights_from_distributed", body)
    assert "no weight update group" in again.json()["message"]  # every rank left it
    # Had a worker kept it, the ranks would disagree on whether "dies" can be joined again.
    trainer = Trainer(checkpoints["v2"], world_size=3, group="dies")
    try:
        joined = post(server, "/init_weights_update_group", trainer.init_payload())
        assert joined.json()["success"], joined.text
        trainer.expect("joined")
        assert post(server, "/destroy_weights_update_group", {"group_name": "dies"}).json()[
            "success"
        ]
    finally:
        trainer.close()


def test_tensors_come_one_payload_per_rank(server, checkpoints, recorded):
    load_from_disk(server, checkpoints["demo"], "0")
    names = sorted(n for n in load_tensors(checkpoints["v2"]) if "mlp.gate." in n)
    sender = TensorSender(checkpoints["v2"], names)
    try:
        body = {"serialized_named_tensors": [sender.payload], "weight_version": "2"}
        answer = post(server, "/update_weights_from_tensor", body)
        assert answer.status_code == 400, answer.text
        assert "takes one per rank" in answer.json()["message"]
        body["serialized_named_tensors"] = [sender.payload, sender.payload]
        answer = post(server, "/update_weights_from_tensor", body)
        assert answer.status_code == 200 and answer.json()["success"], answer.text
    finally:
        assert sender.close() == 0
    assert_serves(server, recorded["v2"], "2")  # v2 differs from the demo in its routers only


def test_a_payload_one_rank_refuses_changes_no_rank(server, checkpoints, recorded):
    """Rank 0's payload is good, rank 1's is mis-shaped: the ranks agree before copying, so
    rank 0 keeps its old routers too."""
    load_from_disk(server, checkpoints["demo"], "0")
    names = sorted(n for n in load_tensors(checkpoints["v2"]) if "mlp.gate." in n)
    good = TensorSender(checkpoints["v2"], names)
    bad = TensorSender(checkpoints["bad"], names)
    try:
        body = {"serialized_named_tensors": [good.payload, bad.payload], "weight_version": "x"}
        answer = post(server, "/update_weights_from_tensor", body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["message"]
        assert message.startswith("tensor-parallel rank 1: ") and "[16, 64]" in message, message
        assert "the weights are unchanged (version '0' still serves)" in message
    finally:
        assert good.close() == 0 and bad.close() == 0
    assert_serves(server, recorded["demo"], "0")


def test_memory_is_released_and_resumed_on_every_rank(server, checkpoints, recorded):
    load_from_disk(server, checkpoints["v1"], "1")
    post(server, "/pause_generation", {})
    assert post(server, "/release_memory_occupation", {}).json() is None
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert sorted(info["released_memory"]) == ["kv_cache", "weights"]
    assert post(server, "/resume_memory_occupation", {}).json() is None
    post(server, "/continue_generation", {})
    assert_serves(server, recorded["v1"], "1")
    # Dropped weights (vLLM's sleep level 2) come back as garbage until new ones arrive.
    post(server, "/pause_generation", {})
    assert httpx.post(server.url + "/sleep?level=2", timeout=60).status_code == 200
    assert httpx.post(server.url + "/wake_up", timeout=60).status_code == 200
    load_from_disk(server, checkpoints["v2"], "2")
    post(server, "/continue_generation", {})
    assert_serves(server, recorded["v2"], "2")
