"""Where a recording's time goes, step by step: start-up phases, step kinds, device gaps.

Runs one workload through the engine (dummy weights of a real config's shape)
and reports:

- start-up: model build, KV sizing (the profiling forward), runner set-up,
  graph capture, each timed apart;
- every step: tokens, sequences, decode-only or mixed, graph or eager, wall
  time between ``step()`` calls, summed per kind;
- optionally a ``torch.profiler`` window over steady-state steps: device
  time per kernel and the device's idle time between kernels.

    python benchmarks/profile_steps.py --config olmoe-1b-7b --workload mixed --profile-steps 30

Workloads as ``benchmarks/workloads.py`` defines them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

T0 = time.perf_counter()
import numpy as np  # noqa: E402
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - T0

from moetrace.config import EngineConfig  # noqa: E402
from moetrace.engine import llm_engine as llm_engine_module  # noqa: E402
from moetrace.engine.llm_engine import LLMEngine  # noqa: E402
from moetrace.engine.model_runner import ModelRunner  # noqa: E402
from moetrace.engine.precompile import start_compile_workers  # noqa: E402
from moetrace.engine.sampling import SamplingParams  # noqa: E402
from moetrace.models.loader import load_model  # noqa: E402

IMPORT_ALL_S = time.perf_counter() - T0
CONFIGS = Path(__file__).parent / "configs"
sys.path.insert(0, str(Path(__file__).parent))
import workloads  # noqa: E402


class Timed:
    """Wraps a function or method and sums the wall time of its calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


def device_gaps(prof) -> dict:
    """Sum of device kernel time and of idle time between consecutive kernels."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    )
    if not kernels:
        return {}
    busy = idle = 0.0
    end = kernels[0][0]
    big_gaps = []
    for s, e in kernels:
        if s > end:
            idle += s - end
            if s - end > 50:
                big_gaps.append(s - end)
        busy += max(0, e - max(s, end))
        end = max(end, e)
    return {
        "span_us": end - kernels[0][0],
        "busy_us": busy,
        "idle_us": idle,
        "gaps_over_50us": len(big_gaps),
        "gap_us_over_50us": float(sum(big_gaps)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="olmoe-1b-7b")
    workloads.add_workload_arguments(parser, num_prompts=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=2048)
    parser.add_argument("--no-capture", action="store_true")
    parser.add_argument("--serial-compile", action="store_true", help="no compile workers")
    parser.add_argument("--profile-steps", type=int, default=0, help="profiler window (steps)")
    parser.add_argument("--profile-after", type=int, default=300, help="steps before the window")
    parser.add_argument(
        "--profile-replay", type=int, default=0, help="after the run: profile this graph's replay"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    if torch.cuda.is_available() and not args.serial_compile:
        start_compile_workers()  # as `moetrace record` does
    timed = Timed()
    timed.wrap(llm_engine_module, "plan_num_blocks", "kv_sizing")
    timed.wrap(ModelRunner, "capture_graphs", "graph_capture")
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
        model = load_model(tmp, device=dev, dtype=dtype, load_format="dummy").model
    sync()
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    engine = LLMEngine(
        model,
        EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager,
            max_cudagraph_capture_size=args.max_cudagraph_capture_size,
            capture_routing=not args.no_capture,
        ),
        dev,
    )
    engine_s = time.perf_counter() - start
    prompts, output_lens = workloads.prompts(args, config["vocab_size"])
    for i, (ids, n) in enumerate(zip(prompts, output_lens, strict=True)):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True), index=i)

    kinds: dict[str, list[float]] = defaultdict(list)
    tokens_by_kind: dict[str, list[int]] = defaultdict(list)
    runner = engine.runner
    original_launch = runner.launch
    last_kind = {"kind": "none"}

    def launch(output, epochs, previous):
        step = original_launch(output, epochs, previous)
        plan = step.plan
        graphs = runner.graphs
        graph = graphs is not None and graphs.bucket(plan.num_tokens) in graphs.graphs
        kind = ("decode" if plan.decode_only else "mixed") + ("/graph" if graph else "/eager")
        last_kind["kind"] = kind
        tokens_by_kind[kind].append(plan.num_tokens)
        return step

    runner.launch = launch
    last_plans = workloads.keep_last_plans(runner.graphs) if runner.graphs else {}
    profile = None
    sync()
    run_start = time.perf_counter()
    mark = run_start
    step = 0
    out_tokens = 0
    first_steps = []
    while engine.has_unfinished():
        if args.profile_steps and step == args.profile_after:
            profile = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            profile.__enter__()
        finished = engine.step()
        out_tokens += sum(f.output_len for f in finished)
        now = time.perf_counter()
        kinds[last_kind["kind"]].append(now - mark)
        if step < 40:
            first_steps.append(round((now - mark) * 1e3, 2))
        mark = now
        step += 1
        if profile is not None and step == args.profile_after + args.profile_steps:
            sync()
            profile.__exit__(None, None, None)
            print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
            gaps = device_gaps(profile)
            print("device gaps:", json.dumps(gaps), flush=True)
            profile = None
    sync()
    wall = time.perf_counter() - run_start
    summary = {
        "config": args.config,
        "workload": args.workload,
        "import_torch_s": IMPORT_TORCH_S,
        "import_all_s": IMPORT_ALL_S,
        "load_s": load_s,
        "engine_s": engine_s,
        "engine_parts_s": dict(timed.seconds),
        "startup": engine.startup.seconds,
        "kernel_variants": engine.startup.kernel_variants,
        "late_compiles": engine.startup.late_compiles,
        "run_s": wall,
        "steps": step,
        "output_tokens": out_tokens,
        "tok_s": out_tokens / wall,
        "first_steps_ms": first_steps,
        "kinds": {
            k: {
                "steps": len(v),
                "wall_s": float(sum(v)),
                "median_ms": float(np.median(v) * 1e3),
                "mean_tokens": float(np.mean(tokens_by_kind[k])) if tokens_by_kind[k] else 0,
            }
            for k, v in kinds.items()
        },
    }
    print(json.dumps(summary, indent=1), flush=True)
    if args.profile_replay and args.profile_replay in last_plans:
        plan = workloads.with_known_tokens(last_plans[args.profile_replay])
        graph = runner.graphs.stage_graph(plan, args.profile_replay)
        for _ in range(3):
            graph.replay()
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
        print("replay gaps (5 replays):", json.dumps(device_gaps(prof)), flush=True)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
