"""A trainer process that pushes weights over torch.distributed, as slime and SkyRL's do.

Run as a script it is rank 0 of a weight-update group: it hosts the TCP store
and builds its group the way slime's ``init_process_group`` (a copy of
torch's, as SGLang has it) does -- the store, under a prefix named after the
group, then torch's process group helper -- then waits for JSON commands
on standard input: ``{"send": [[name, dtype, shape], ...]}`` broadcasts each
tensor from a safetensors checkpoint (cast to ``dtype``; random values for a
name or shape it lacks, so a wrong update can be sent), one ``broadcast``
each or packed into byte buffers as vLLM's packed transfer does;
``die_after`` kills it after that many broadcasts; ``{"exit": true}`` leaves.
It runs gloo on the CPU, or NCCL with its tensors on a GPU of its own.

``Trainer`` drives such a process from a test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Trainer:
    """A trainer process (rank 0 of ``world_size``) and the pipe that drives it."""

    def __init__(
        self,
        checkpoint: Path,
        *,
        group: str = "weight_update_group",
        world_size: int = 2,
        timeout_s: float = 60.0,
        backend: str = "gloo",
        device: str = "cpu",
    ) -> None:
        self.port = free_port()
        self.group = group
        self.world_size = world_size
        self.backend = backend
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(self.port), str(world_size), group, str(checkpoint)]
            + [str(timeout_s), backend, device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.expect("listening")  # its store is up: the server's ranks may join now

    def init_payload(self, rank_offset: int = 1) -> dict:
        """SGLang's ``init_weights_update_group`` body for this group."""
        return {
            "master_address": "127.0.0.1",
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "group_name": self.group,
            "backend": self.backend,
        }

    def expect(self, word: str, timeout_s: float = 60.0) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            self.proc.kill()
            raise AssertionError(f"trainer said {line!r}, not {word!r}: {self.proc.stderr.read()}")
        return line

    def send(self, specs: list, *, packed: int | None = None, die_after: int | None = None):
        """Broadcast ``specs`` ([name, dtype, shape] each); returns once sent."""
        command = {"send": specs, "packed": packed, "die_after": die_after}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        if die_after is None:
            self.expect("sent")

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
                self.proc.stdin.flush()
                return self.proc.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait(30)


def specs_of(tensors: dict, names: list[str] | None = None) -> list:
    """[name, dtype, shape] for ``names`` (all of ``tensors`` by default), as trainers send."""
    return [
        [name, str(tensors[name].dtype).removeprefix("torch."), list(tensors[name].shape)]
        for name in (names or sorted(tensors))
    ]


def distributed_update(specs: list, **fields) -> dict:
    """SGLang's ``update_weights_from_distributed`` body for ``specs`` ([name, dtype, shape])."""
    return {
        "names": [s[0] for s in specs],
        "dtypes": [s[1] for s in specs],
        "shapes": [s[2] for s in specs],
        **fields,
    }


# ------------------------------------------------------------------------ the process


def _main(
    port: int,
    world_size: int,
    group: str,
    checkpoint: str,
    timeout_s: float,
    backend: str,
    device_name: str,
) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"), device=device_name)
    timeout = timedelta(seconds=timeout_s)
    # The store first, saying so: the server's ranks may only come once it listens (the
    # rendezvous slime runs does the same in one call, and waits for them inside).
    store = TCPStore(
        "127.0.0.1", port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )
    print("listening", flush=True)
    pg, _ = _new_process_group_helper(
        world_size, 0, [], Backend(backend), PrefixStore(group, store), group_name=group,
        timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    print("joined", flush=True)
    generator = torch.Generator().manual_seed(0)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        out = []
        for name, dtype_name, shape in command["send"]:
            dtype = getattr(torch, dtype_name)
            have = tensors.get(name)
            if have is not None and list(have.shape) == shape:
                out.append(have.to(dtype).contiguous())
            else:
                out.append(torch.randn(shape, generator=generator).to(device=device, dtype=dtype))
        if command.get("packed"):
            out = _packed(out, command["packed"])
        for count, tensor in enumerate(out):
            if command.get("die_after") is not None and count == command["die_after"]:
                os._exit(3)  # the trainer dies mid-update
            dist.broadcast(tensor, 0, group=pg)
        print(f"sent {len(out)}", flush=True)
    dist.destroy_process_group(pg)


def _packed(tensors: list, buffer_bytes: int) -> list:
    """vLLM's packing: tensors' bytes concatenated until a buffer passes ``buffer_bytes``."""
    import torch

    buffers, current, total = [], [], 0
    for tensor in tensors:
        current.append(tensor.contiguous().view(torch.uint8).reshape(-1))
        total += current[-1].numel()
        if total > buffer_bytes:
            buffers.append(torch.cat(current))
            current, total = [], 0
    if current:
        buffers.append(torch.cat(current))
    return buffers


if __name__ == "__main__":
    port_, world_, group_, checkpoint_, timeout_, backend_, device_ = sys.argv[1:8]
    _main(int(port_), int(world_), group_, checkpoint_, float(timeout_), backend_, device_)
