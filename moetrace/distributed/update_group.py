"""The process group a trainer broadcasts new weights over, joined from the server's side.

The convention of SGLang's ``init_weights_update_group`` (slime, AReaL, ROLL,
verl): the trainer is rank 0 and hosts the TCP store at ``master_address:
master_port``; the server's ranks are ``rank_offset ..`` in ``world_size``.
The group is built the way SGLang's ``init_custom_process_group`` and those
trainers build it -- a rendezvous, the store under a prefix named after the
group, torch's process group of that backend -- because both sides must look
for the same keys in the store.  It is never the default group (a
tensor-parallel server has that already).

Each tensor then arrives as one ``broadcast`` from rank 0, in the order the
update call names them, or packed into byte buffers (vLLM's ``packed``
transfer: tensors concatenated until a buffer passes ``buffer_bytes``, the
same rule on both sides).  A broadcast that does not come within the group's
timeout, or a trainer that dies, raises ``UpdateGroupError``; the group is
then unusable and is left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

from moetrace.errors import MoetraceError

BACKENDS = ("nccl", "gloo")


class UpdateGroupError(MoetraceError):
    """The trainer's group could not be joined, or a transfer over it failed."""


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class UpdateGroup:
    """This process's membership in a trainer's weight-update group."""

    def __init__(self, pg: dist.ProcessGroup, name: str, rank: int, world_size: int) -> None:
        self.pg = pg
        self.name = name
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def join(
        cls,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> UpdateGroup:
        """Meet the trainer (rank 0) and the other ranks; blocks until all have joined."""
        if backend not in BACKENDS:
            raise UpdateGroupError(f"backend {backend!r}: choose {' or '.join(BACKENDS)}")
        if not 0 < rank < world_size:
            raise UpdateGroupError(
                f"rank {rank} (rank_offset) is not one of the group's 1..{world_size - 1} "
                "(rank 0 is the trainer)"
            )
        timeout = timedelta(seconds=timeout_s)
        url = f"tcp://{_url_host(master_address)}:{master_port}"
        try:
            store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(
                world_size,
                rank,
                [],
                Backend(backend),
                PrefixStore(group_name, store),
                group_name=group_name,
                timeout=timeout,
            )
        except (RuntimeError, ValueError, OSError, TimeoutError) as exc:
            raise UpdateGroupError(
                f"could not join group {group_name!r} at {master_address}:{master_port} as rank "
                f"{rank} of {world_size}: {_one_line(exc)}"
            ) from None
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return cls(pg, group_name, rank, world_size)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Receive ``tensor`` (filled in place) from rank 0."""
        try:
            dist.broadcast(tensor, src=0, group=self.pg)
        except (RuntimeError, ValueError, OSError, TimeoutError) as exc:
            raise UpdateGroupError(
                f"the broadcast from the trainer over group {self.name!r} failed: {_one_line(exc)}"
            ) from None

    def receive(
        self, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device
    ) -> list[torch.Tensor]:
        """One broadcast per tensor, in order, each into a new tensor."""
        out = []
        for shape, dtype in shapes:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            self.broadcast(tensor)
            out.append(tensor)
        return out

    def receive_packed(
        self,
        shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        buffer_bytes: int,
    ) -> list[torch.Tensor]:
        """vLLM's packed transfer: byte buffers of consecutive tensors, one broadcast each."""
        out: list[torch.Tensor] = []
        for chunk in packed_chunks([_nbytes(s, d) for s, d in shapes], buffer_bytes):
            sizes = [_nbytes(*shapes[i]) for i in chunk]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            self.broadcast(buffer)
            for i, piece in zip(chunk, buffer.split(sizes), strict=True):
                shape, dtype = shapes[i]
                out.append(piece.view(dtype).view(shape))
        return out

    def leave(self) -> None:
        # A group a failed collective broke may refuse to be destroyed: nothing left to free.
        with contextlib.suppress(RuntimeError, ValueError, KeyError):
            dist.destroy_process_group(self.pg)


def packed_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed buffer: tensors are added until the buffer
    holds more than ``buffer_bytes`` (so the last one may cross it), vLLM's rule."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > buffer_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
