"""The server's side of a trainer's weight-update group, against a real trainer process (gloo).

The trainer (tests/support/trainer.py) builds its side as slime does; this
process joins as rank 1 and receives, one broadcast per tensor or packed as
vLLM packs them.  A trainer that dies or never sends must end the wait with
one line, not hang or kill the server.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.checkpoints import demo_tensors
from support.trainer import Trainer, specs_of

from moetrace.distributed.update_group import UpdateGroup, UpdateGroupError, packed_chunks
from moetrace.models.demo import DEMO_DIR

CPU = torch.device("cpu")
NAMES = [
    "model.layers.1.mlp.gate.weight",
    "model.norm.weight",
    "model.layers.2.self_attn.o_proj.weight",
    "model.embed_tokens.weight",
]


def join(trainer: Trainer, timeout_s: float = 30.0) -> UpdateGroup:
    group = UpdateGroup.join(
        master_address="127.0.0.1",
        master_port=trainer.port,
        rank=1,
        world_size=trainer.world_size,
        group_name=trainer.group,
        backend="gloo",
        timeout_s=timeout_s,
    )
    trainer.expect("joined")
    return group


def shapes(names):
    tensors = demo_tensors()
    return [(tuple(tensors[n].shape), tensors[n].dtype) for n in names]


@pytest.mark.parametrize("packed", [None, 40_000], ids=["per-tensor", "packed"])
def test_the_trainers_tensors_arrive_whole(packed):
    tensors = demo_tensors()
    trainer = Trainer(DEMO_DIR, group=f"g-{packed}")
    try:
        group = join(trainer)
        import threading

        got: list = []
        receiver = threading.Thread(
            target=lambda: got.extend(
                group.receive_packed(shapes(NAMES), CPU, packed)
                if packed
                else group.receive(shapes(NAMES), CPU)
            )
        )
        receiver.start()
        trainer.send(specs_of(tensors, NAMES), packed=packed)
        receiver.join(30)
        for name, tensor in zip(NAMES, got, strict=True):
            assert torch.equal(tensor, tensors[name]), name
        group.leave()
    finally:
        assert trainer.close() == 0


def test_packed_buffers_close_once_past_the_size():
    assert packed_chunks([4, 4, 4, 4, 4], 8) == [[0, 1, 2], [3, 4]]
    assert packed_chunks([20, 1], 8) == [[0], [1]]
    assert packed_chunks([1, 1], 8) == [[0, 1]]


def test_a_trainer_that_dies_mid_update_ends_the_wait_with_one_line():
    trainer = Trainer(DEMO_DIR, group="dies")
    try:
        group = join(trainer)
        trainer.send(specs_of(demo_tensors(), NAMES), die_after=2)
        with pytest.raises(UpdateGroupError, match="broadcast from the trainer over group 'dies'"):
            group.receive(shapes(NAMES), CPU)
        group.leave()
    finally:
        trainer.close()


def test_a_broadcast_that_never_comes_times_out():
    trainer = Trainer(DEMO_DIR, group="silent")
    try:
        group = join(trainer, timeout_s=2.0)
        start = time.monotonic()
        with pytest.raises(UpdateGroupError, match="failed"):
            group.receive(shapes(NAMES[:1]), CPU)
        assert time.monotonic() - start < 30
        group.leave()
    finally:
        trainer.close()


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(UpdateGroupError, match="rank 0 .* is not one of the group's 1..1"):
        UpdateGroup.join(
            master_address="127.0.0.1", master_port=1, rank=0, world_size=2, group_name="g",
            backend="gloo", timeout_s=1,
        )  # fmt: skip
    with pytest.raises(UpdateGroupError, match="backend 'mpi'"):
        UpdateGroup.join(
            master_address="127.0.0.1", master_port=1, rank=1, world_size=2, group_name="g",
            backend="mpi", timeout_s=1,
        )  # fmt: skip


def test_nobody_hosting_the_store_is_an_error_after_the_timeout():
    from support.trainer import free_port

    with pytest.raises(UpdateGroupError, match="could not join group 'nobody'"):
        UpdateGroup.join(
            master_address="127.0.0.1", master_port=free_port(), rank=1, world_size=2,
            group_name="nobody", backend="gloo", timeout_s=1,
        )  # fmt: skip
