"""Weight updates of a served engine: seconds per GB against the copy bound, memory given back.

What an RL loop pays between steps.  The engine holds dummy weights of a
real config's shapes (``benchmarks/configs/*.json``); new weights of the same
shapes arrive by each transport and are checked and copied in place
(``engine/weight_update.py``):

- ``tensor``: device tensors handed over in buckets (what a colocated
  trainer's CUDA IPC handles open to), check + copy;
- ``disk``: a safetensors checkpoint written to a temporary directory, then
  ``update_weights_from_disk``'s check and load (read from the page cache it
  was just written to, so a cold disk is slower);
- ``group``: a trainer process (this script with ``--trainer``) broadcasting
  every tensor over a process group -- gloo on the CPU, NCCL with a second
  GPU; one GPU cannot host both NCCL ranks.

The copy bound is the bytes over the device's own copy bandwidth (a timed
device-to-device copy): no update can be faster.  Then the memory release:
``torch.cuda.mem_get_info`` before and after releasing the weights and the
KV cache, against the bytes the engine held, and a greedy run before the
release equal to one after the resume.

    python benchmarks/weight_update.py --config qwen3-30b-a3b --num-hidden-layers 12
    python benchmarks/weight_update.py --config tiny-qwen3 --device cpu      # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from moetrace.config import EngineConfig
from moetrace.distributed.update_group import UpdateGroup
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.memory_release import TAGS, MemoryRelease
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.weight_update import TensorSpec, WeightUpdater
from moetrace.models.loader import load_model

CONFIGS = Path(__file__).parent / "configs"
GB = 1e9


def checkpoint_shapes(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each checkpoint name's shape, from where the weight map puts it (families whose
    every tensor is a plain copy: Qwen3/Qwen2-MoE, OLMoE, Mixtral, ...)."""
    weights = model.weights
    out = {}
    for name in sorted(model.expected_weight_names()):
        dest = weights.destination(name)
        if dest is None:
            raise SystemExit(f"{name}: converted on load; this benchmark takes plain families")
        out[name] = (tuple(dest.shape), dest.dtype)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, dtype: torch.dtype, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (the floor of any in-place update)."""
    count = nbytes // dtype.itemsize
    src = torch.empty(count, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    return 3 * count * dtype.itemsize / (time.perf_counter() - start)


def buckets(shapes: dict, bucket_bytes: int) -> list[list[str]]:
    out, current, size = [], [], 0
    for name, (shape, dtype) in shapes.items():
        current.append(name)
        size += int(np.prod(shape)) * dtype.itemsize
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def random_tensor(shape, dtype, device, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)


def bench_tensor(updater, shapes, device, bucket_bytes) -> float:
    gen = torch.Generator(device=device).manual_seed(1)
    total = 0.0
    for bucket in buckets(shapes, bucket_bytes):
        named = [(n, random_tensor(*shapes[n], device, gen)) for n in bucket]
        sync(device)
        start = time.perf_counter()
        updater.check([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named])
        updater.load(named)
        sync(device)
        total += time.perf_counter() - start
    return total


def bench_disk(updater, shapes, device, tmp: Path, config: dict) -> float:
    gen = torch.Generator().manual_seed(2)
    (tmp / "config.json").write_text(json.dumps(config))
    tensors = {n: random_tensor(s, d, "cpu", gen) for n, (s, d) in shapes.items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    del tensors
    start = time.perf_counter()
    updater.check_checkpoint(tmp)
    updater.load_checkpoint(tmp, device)
    sync(device)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_group(updater, shapes, device, backend: str, trainer_device: str) -> float:
    port = free_port()
    spec = json.dumps({n: [list(s), str(d).removeprefix("torch.")] for n, (s, d) in shapes.items()})
    trainer = subprocess.Popen(
        [sys.executable, __file__, "--trainer", str(port), backend, trainer_device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert trainer.stdin is not None and trainer.stdout is not None
    trainer.stdin.write(spec + "\n")
    trainer.stdin.flush()
    group = UpdateGroup.join(
        master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
        group_name="bench", backend=backend, timeout_s=600,
    )  # fmt: skip
    assert trainer.stdout.readline().startswith("joined")
    specs = [(s, d) for s, d in shapes.values()]
    start = time.perf_counter()
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    received = group.receive(specs, device)
    updater.load(zip(shapes, received, strict=True))
    sync(device)
    seconds = time.perf_counter() - start
    group.leave()
    trainer.wait(120)
    return seconds


def trainer_main(port: int, backend: str, device_name: str) -> None:
    """The trainer's side: rank 0 hosting the group, as SGLang's trainers build it."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shapes = json.loads(sys.stdin.readline())
    timeout = timedelta(seconds=600)
    store, rank, size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    pg, _ = _new_process_group_helper(
        size, rank, [], Backend(backend), PrefixStore("bench", store), group_name="bench",
        timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    gen = torch.Generator(device=device).manual_seed(3)
    tensors = [random_tensor(s, getattr(torch, d), device, gen) for s, d in shapes.values()]
    print("joined", flush=True)
    sys.stdin.readline()
    for tensor in tensors:
        dist.broadcast(tensor, 0, group=pg)
    dist.destroy_process_group(pg)


def greedy(engine: LLMEngine, tag: str) -> dict:
    rng = np.random.default_rng(0)
    for i in range(8):
        ids = rng.integers(0, engine.model.vocab_size, 64).tolist()
        engine.add_request(f"{tag}{i}", ids, SamplingParams(max_tokens=16))
    return {f.request_id.removeprefix(tag): f for f in engine.run()}


def bench_release(engine: LLMEngine, device: torch.device) -> dict:
    before = greedy(engine, "before-")
    params = sum(p.numel() * p.element_size() for p in dict.fromkeys(engine.model.parameters()))
    cache = sum(t.numel() * t.element_size() for c in engine.runner.kv_caches for t in c)
    out: dict = {"held_gb": (params + cache) / GB}
    memory = MemoryRelease(engine)
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    memory.release(TAGS)
    out["release_s"] = time.perf_counter() - start
    if device.type == "cuda":
        out["released_gb"] = (torch.cuda.mem_get_info()[0] - free_before) / GB
        out["released_share"] = out["released_gb"] / out["held_gb"]
    start = time.perf_counter()
    memory.resume(TAGS)
    sync(device)
    out["resume_s"] = time.perf_counter() - start
    after = greedy(engine, "after-")
    out["same_after_resume"] = all(
        np.array_equal(before[k].routed_experts, after[k].routed_experts)
        and np.array_equal(before[k].output_token_ids, after[k].output_token_ids)
        for k in before
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--num-hidden-layers", type=int, help="fewer layers (the disk's size)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--transports", default="tensor,disk,group")
    parser.add_argument("--bucket-gb", type=float, default=1.0)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--trainer", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer_main(int(args.trainer[0]), args.trainer[1], args.trainer[2])
        return
    device = torch.device(args.device)
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    if args.num_hidden_layers:
        config["num_hidden_layers"] = args.num_hidden_layers
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        loaded = load_model(tmp, device=device, dtype=dtype, load_format="dummy")
    engine = LLMEngine(
        loaded.model, EngineConfig(num_kv_blocks=args.num_kv_blocks, block_size=16), device
    )
    updater = WeightUpdater(engine.model)
    updater.check([])  # its meta twin is built once, at the first update: not timed here
    shapes = checkpoint_shapes(engine.model)
    nbytes = sum(int(np.prod(s)) * d.itemsize for s, d in shapes.values())
    bandwidth = copy_bandwidth(device, loaded.dtype)
    results: dict = {
        "config": args.config,
        "num_hidden_layers": config["num_hidden_layers"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "update_gb": nbytes / GB,
        "copy_gb_per_s": bandwidth / GB,
        "copy_bound_s": nbytes / bandwidth,
        "transports": {},
    }
    for transport in args.transports.split(","):
        if transport == "tensor":
            seconds = bench_tensor(updater, shapes, device, int(args.bucket_gb * GB))
        elif transport == "disk":
            with tempfile.TemporaryDirectory() as tmp:
                seconds = bench_disk(updater, shapes, device, Path(tmp), config)
        elif transport == "group":
            if device.type == "cuda" and torch.cuda.device_count() < 2:
                print("group: skipped (NCCL needs a second GPU for the trainer)", file=sys.stderr)
                continue
            backend, trainer = ("nccl", "cuda:1") if device.type == "cuda" else ("gloo", "cpu")
            seconds = bench_group(updater, shapes, device, backend, trainer)
        else:
            raise SystemExit(f"unknown transport {transport!r}")
        results["transports"][transport] = {
            "seconds": seconds,
            "s_per_gb": seconds / (nbytes / GB),
            "x_copy_bound": seconds / results["copy_bound_s"],
        }
    results["release"] = bench_release(engine, device)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
