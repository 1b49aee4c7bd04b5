"""Who this process is in a tensor-parallel group, and the collectives it uses.

One process per device.  Two process groups over the same ranks, as vLLM
keeps them: the *device* group (NCCL on CUDA, gloo on CPU) carries the
forward's all-reduces and gathers on the device's own streams; the *cpu*
group (always gloo) carries the per-step host messages, so that sending a
step's inputs never waits behind queued GPU work.

The state is process-global (set once by the launcher, read by the loader,
the model runner and the memory planner) because those are deep in code that
single-device runs share; ``None`` means "one device", the default path.
"""

from __future__ import annotations

import pickle
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases (the GPU machine's 2.11) lack the new names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ParallelConfig:
    """The user's parallelism options (vLLM's names)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    sequence_parallel_moe: bool = False

    @property
    def enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TensorParallelLayout:
    """This rank's place in the group: enough to shard weights, no communication."""

    rank: int
    size: int
    expert_parallel: bool = False
    sequence_parallel: bool = False

    @classmethod
    def of(cls, config: ParallelConfig, rank: int) -> TensorParallelLayout:
        return cls(
            rank,
            config.tensor_parallel_size,
            config.enable_expert_parallel,
            config.sequence_parallel_moe,
        )


@dataclass
class SequenceParallelContext:
    """Per-forward facts the sequence-parallel MoE hooks and capturer share.

    Set by the MoE block's pre-hook (the step's token count is only known
    there); read by the experts' hooks and the capturer in the same layer.
    """

    num_tokens: int = 0
    chunk: int = 0
    padded_input: torch.Tensor | None = None


class Collectives:
    """The group's collectives, named for what the model needs rather than by backend."""

    def __init__(
        self,
        device_group: dist.ProcessGroup | None,
        cpu_group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        leader: int = 0,
    ) -> None:
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.rank = rank
        self.size = size
        self.leader = leader  # global rank of tensor-parallel rank 0

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather_rows(self, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``[c, ...]`` rows, rank after rank: ``[size * c, ...]``."""
        local = local.contiguous()
        if out is None:
            out = local.new_empty((self.size * local.shape[0], *local.shape[1:]))
        _all_gather_flat(out, local, group=self.device_group)
        return out

    def reduce_scatter_rows(self, full: torch.Tensor) -> torch.Tensor:
        """Sum ``[size * c, ...]`` over ranks and keep this rank's ``[c, ...]`` rows."""
        full = full.contiguous()
        out = full.new_empty((full.shape[0] // self.size, *full.shape[1:]))
        _reduce_scatter_flat(out, full, group=self.device_group)
        return out

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank, on the device (no host round trip)."""
        dist.broadcast(tensor, src=self.leader, group=self.device_group)
        return tensor

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's host object on every rank, over the cpu group.

        One length broadcast and one payload broadcast of a pickle; torch's
        ``broadcast_object_list`` does the same with more copies.
        """
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self.leader, group=self.cpu_group)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=self.leader, group=self.cpu_group)
        if self.rank == 0:
            return obj
        return pickle.loads(payload.numpy().tobytes())

    def gather_objects(self, obj: object) -> list:
        """Every rank's host object, in rank order, on every rank (over the cpu group): how
        the ranks agree on a verdict before acting on it."""
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def release(self) -> None:
        """Drop the groups before they are destroyed.

        A process group still referenced at interpreter exit is destroyed during
        finalization, where gloo's threads abort the process ("terminate called
        without an active exception"); models and hooks keep this object alive.
        """
        self.device_group = None
        self.cpu_group = None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. how many KV blocks fit on all devices)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


@dataclass
class ParallelState:
    config: ParallelConfig
    layout: TensorParallelLayout
    comm: Collectives
    device: torch.device
    sp: SequenceParallelContext = field(default_factory=SequenceParallelContext)

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def size(self) -> int:
        return self.layout.size


_STATE: ParallelState | None = None


def get_parallel_state() -> ParallelState | None:
    """The process's tensor-parallel state; None on a single device."""
    return _STATE


def set_parallel_state(state: ParallelState | None) -> None:
    global _STATE
    _STATE = state
