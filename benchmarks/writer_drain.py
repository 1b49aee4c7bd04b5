"""What draining a burst of finished requests into a trace costs, per capture mode, on the CPU.

The end of a uniform recording: every request finishes in one step and the
run waits until the trace writer has written them all and closed the file.
This times exactly that, with synthetic requests in a real checkpoint's
routing shapes (``benchmarks/configs``): submit every request, close, and
report the wall time and the writer thread's CPU time (file creation
excluded), for ids only, + float16 / float32 gate weights, + log-probs.

    python benchmarks/writer_drain.py --config olmoe-1b-7b --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from moetrace.trace.metadata import TraceMetadata, expert_id_dtype
from moetrace.trace.records import FinishedRequest
from moetrace.trace.writer import TraceWriter

CONFIGS = Path(__file__).parent / "configs"
MODES = {  # mode -> (gate weights dtype, log-probs)
    "ids": (None, False),
    "ids+float16": ("float16", False),
    "ids+float32": ("float32", False),
    "ids+logprobs": (None, True),
    "ids+float16+logprobs": ("float16", True),
}


def routing_shape(config: dict) -> tuple[int, int, int]:
    """(MoE layers, top-k, experts), counting every layer as MoE (an upper bound)."""
    experts = (
        config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"]
    )
    return config["num_hidden_layers"], config["num_experts_per_tok"], experts


def requests(args, shape, weights: str | None, logprobs: bool) -> list[FinishedRequest]:
    layers, k, experts = shape
    rng = np.random.default_rng(0)
    rows = args.prompt_len + args.output_len - 1
    out = []
    for i in range(args.num_prompts):
        ids = rng.integers(0, experts, (rows, layers, k)).astype(expert_id_dtype(experts))
        w = None if weights is None else rng.random((rows, layers, k)).astype(weights)
        lp = -rng.random(args.output_len).astype(np.float32) if logprobs else None
        out.append(
            FinishedRequest(
                f"r{i}",
                i,
                rng.integers(0, 1000, args.prompt_len).astype(np.int32),
                rng.integers(0, 1000, args.output_len).astype(np.int32),
                ids,
                "length",
                routed_weights=w,
                output_logprobs=lp,
            )
        )
    return out


def drain(path: Path, md: TraceMetadata, reqs: list[FinishedRequest]) -> tuple[float, float]:
    """(wall s from the first submit to closed, writer thread CPU s after the file was made)."""
    cpu: list[float] = []
    writer = TraceWriter(path, md, overwrite=True)
    loop = writer._loop

    def timed_loop():
        start = time.thread_time()
        try:
            return loop()
        finally:
            cpu.append(start)

    run = writer._run

    def timed_run():
        run()
        cpu.append(time.thread_time())

    writer._loop, writer._run = timed_loop, timed_run
    writer.start()
    start = time.perf_counter()
    for r in reqs:
        writer.submit(r)
    writer.close()
    return time.perf_counter() - start, cpu[1] - cpu[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="olmoe-1b-7b", help="name under benchmarks/configs")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trace-dir", default=None)
    args = parser.parse_args()
    shape = routing_shape(json.loads((CONFIGS / f"{args.config}.json").read_text()))
    print(f"{args.config}: {args.num_prompts} requests of {args.prompt_len} + {args.output_len}")
    print("| mode | drain ms (median) | writer CPU ms (median) |\n|---|---|---|")
    for mode, (weights, logprobs) in MODES.items():
        md = TraceMetadata(
            "bench", "bench", "", shape[0], list(range(shape[0])), shape[2], shape[1], 1000,
            weights_dtype=weights, logprobs=logprobs,
        )  # fmt: skip
        reqs = requests(args, shape, weights, logprobs)
        walls, cpus = [], []
        with tempfile.TemporaryDirectory(dir=args.trace_dir) as tmp:
            for _ in range(args.repeats):
                wall, cpu = drain(Path(tmp) / "t.h5", md, reqs)
                walls.append(wall)
                cpus.append(cpu)
        print(
            f"| {mode} | {1e3 * statistics.median(walls):.1f} | {1e3 * statistics.median(cpus):.1f} |"
        )


if __name__ == "__main__":
    main()
