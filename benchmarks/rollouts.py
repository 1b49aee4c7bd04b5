"""RL rollouts through the engine, as a trainer's rollout step asks for them, held against
the sum of the bounds of the steps that ran.

The ``grpo`` workload (``benchmarks/workloads.py``): 128 prompts of 1,024 random tokens,
each sampled 8 times (eight requests with the same prompt ids and their own seeds, all
queued at once), outputs long-tailed between 256 and 8,192 tokens, temperature 1.0, EOS
ignored so each request ends at its drawn length, routing capture and log-probs on,
prefix caching on, and the KV cache sized from memory at ``--gpu-memory-utilization``.
Weights are random (``dummy``) in the shapes of ``benchmarks/configs/<name>.json``.  One
engine runs an unmeasured warm-up (the same lengths, other prompt ids, so the measured
run finds none of them cached), then the measured run.

Reported, and written to ``--out``: output tok/s; the run's wall time against the sum of
its steps' bounds (``benchmarks/step_bounds.py``, at the matmul and copy rates measured
on the device at start); the tail, from the moment 95% of the requests have finished to
the end, with the batch over time; the KV capacity in tokens, preemptions, and the
prompt tokens the prefix cache served.

Each step's shape is noted as the runner launches it (a list append); the experts its
tokens reached come after the run from the routing the finished requests recorded at
those positions.

    python benchmarks/rollouts.py --config olmoe-1b-7b --out rollouts.json
    python benchmarks/rollouts.py --config tiny-qwen3 --num-prompts 2 --prompt-len 24 --output-range 4-40
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moetrace.config import EngineConfig
from moetrace.engine.cpu_threads import configure_cpu_threads
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import load_model
from moetrace.trace.records import FinishedRequest

sys.path.insert(0, str(Path(__file__).parent))
import step_bounds  # noqa: E402
import workloads  # noqa: E402
from throughput import CONFIGS, device, sync  # noqa: E402

TAIL_SHARE = 0.95  # the tail starts when this share of the requests has finished


@dataclass
class Launch:
    """One step as the runner launched it: references to its plan's arrays, no copies."""

    at: float  # seconds since the run started
    query_start: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]
    requests: list  # the plan's requests, in batch order
    sampled_rows: int


@dataclass
class Rollouts:
    seconds: float
    finished: list[FinishedRequest]
    finished_at: np.ndarray  # seconds since the start at which each request came back, sorted
    launches: list[Launch]
    preemptions: int


def build_engine(model, args, max_model_len: int) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        capture_routing=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
    )
    return LLMEngine(model, config, device())


def run_rollouts(
    engine: LLMEngine, prompts: list[list[int]], output_lens: list[int], args
) -> Rollouts:
    """Queue every request at once and step until all have finished, noting each launch."""
    launches: list[Launch] = []
    launch = engine.runner.launch

    def noting(output, epochs, previous):
        at = time.perf_counter() - start
        step = launch(output, epochs, previous)
        plan = step.plan
        launches.append(
            Launch(at, plan.query_start, plan.seq_lens, plan.requests, len(plan.logits_rows))
        )
        return step

    preempted_before = engine.stats.preemptions
    finished: list[FinishedRequest] = []
    finished_at: list[float] = []
    sync()
    start = time.perf_counter()
    engine.runner.launch = noting
    try:
        for i, (ids, n) in enumerate(zip(prompts, output_lens, strict=True)):
            sampling = SamplingParams(
                max_tokens=n,
                temperature=args.temperature,
                seed=args.seed + i,
                ignore_eos=True,
                logprobs=0 if args.logprobs else None,
            )
            engine.add_request(f"r{i}", ids, sampling, index=i)
        while engine.has_unfinished():
            done = engine.step()
            if done:
                finished += done
                finished_at += [time.perf_counter() - start] * len(done)
        sync()
        seconds = time.perf_counter() - start
    finally:
        del engine.runner.launch  # the class's own method again
    return Rollouts(
        seconds,
        finished,
        np.asarray(finished_at),
        launches,
        engine.stats.preemptions - preempted_before,
    )


def experts_reached(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """Distinct experts per MoE layer among routing rows ``[n, layers, top_k]``."""
    layers = rows.shape[1]
    keys = rows.astype(np.int64) + (np.arange(layers, dtype=np.int64) * num_experts)[:, None]
    counts = np.bincount(keys.ravel(), minlength=layers * num_experts)
    return (counts.reshape(layers, num_experts) > 0).sum(axis=1).astype(np.int64)


def step_shapes(run: Rollouts, num_experts: int) -> list[step_bounds.StepShape]:
    """Each launched step's shape, with the experts its tokens reached taken from the rows
    the finished requests recorded at the positions the step ran (a recomputed preempted
    token counts with the row of its last computation)."""
    by_id = {f.request_id: f.routed_experts for f in run.finished}
    sizes = np.array([len(rows) for rows in by_id.values()], dtype=np.int64)
    offsets = dict(zip(by_id, np.cumsum(sizes) - sizes, strict=True))
    limits = dict(zip(by_id, sizes, strict=True))
    flat = np.concatenate(list(by_id.values()))
    shapes = []
    for launch in run.launches:
        counts = np.diff(launch.query_start).astype(np.int64)
        seq_lens = launch.seq_lens.astype(np.int64)
        ids = [r.request_id for r in launch.requests]
        seq = np.repeat(np.arange(len(ids)), counts)
        first = np.asarray(launch.query_start[:-1], dtype=np.int64)
        positions = np.arange(counts.sum()) - first[seq] + (seq_lens - counts)[seq]
        base = np.array([offsets[i] for i in ids], dtype=np.int64)[seq]
        kept = positions < np.array([limits[i] for i in ids], dtype=np.int64)[seq]
        rows = flat[(base + positions)[kept]]
        shapes.append(
            step_bounds.StepShape(
                counts, seq_lens, launch.sampled_rows, experts_reached(rows, num_experts)
            )
        )
    return shapes


def tail(finished_at: np.ndarray, seconds: float, share: float = TAIL_SHARE) -> dict:
    """From the moment ``share`` of the requests had come back to the end of the run."""
    k = max(1, math.ceil(share * len(finished_at)))
    since = float(finished_at[k - 1])
    return {
        "requests": len(finished_at) - k,
        "from_s": since,
        "seconds": seconds - since,
        "share_of_run": (seconds - since) / seconds,
    }


def batch_over_time(
    run: Rollouts, shapes: list, bounds: np.ndarray, slices: int = 10
) -> list[dict]:
    """The run cut into ``slices`` equal spans: steps launched in each, their sequences and
    tokens, output tok/s, their bounds' share of the span, requests finished by its end."""
    at = np.array([launch.at for launch in run.launches])
    seqs = np.array([len(s.new_tokens) for s in shapes])
    tokens = np.array([s.num_tokens for s in shapes])
    sampled = np.array([s.sampled_rows for s in shapes])
    edges = np.linspace(0.0, run.seconds, slices + 1)
    table = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        mask = (at >= lo) & (at < hi)
        steps = int(mask.sum())
        table.append(
            {
                "from_s": float(lo),
                "to_s": float(hi),
                "steps": steps,
                "seqs_per_step": float(seqs[mask].mean()) if steps else 0.0,
                "tokens_per_step": float(tokens[mask].mean()) if steps else 0.0,
                "output_tok_s": float(sampled[mask].sum() / (hi - lo)),
                "bound_share": float(bounds[mask].sum() / (hi - lo)),
                "finished": int((run.finished_at <= hi).sum()),
            }
        )
    return table


def summarise(run: Rollouts, shapes: list, costs, rates) -> dict:
    """The figures of a run: throughput, the steps' bounds, the tail, the batch over time."""
    parts = np.array([step_bounds.step_bound(costs, s, rates) for s in shapes])  # [steps, 2]
    bounds = parts.max(axis=1)
    at = np.array([launch.at for launch in run.launches])
    spans = np.diff(np.append(at, run.seconds))  # launch to next launch: about a step's time
    prefill = np.array([int(s.new_tokens.max()) > 1 for s in shapes])
    output_tokens = sum(f.output_len for f in run.finished)
    prompt_tokens = sum(len(f.prompt_token_ids) for f in run.finished)
    distinct = {f.prompt_token_ids.tobytes(): len(f.prompt_token_ids) for f in run.finished}
    bound_s = float(bounds.sum())
    return {
        "seconds": run.seconds,
        "requests": len(run.finished),
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / run.seconds,
        "steps": len(shapes),
        "bound_s": bound_s,
        "wall_over_bound": run.seconds / bound_s,
        "flop_bound_steps": int((parts[:, 0] > parts[:, 1]).sum()),
        "phases": {
            name: {
                "steps": int(mask.sum()),
                "tokens": int(sum(s.num_tokens for s, m in zip(shapes, mask, strict=True) if m)),
                "seconds": float(spans[mask].sum()),
                "bound_s": float(bounds[mask].sum()),
            }
            for name, mask in (("with_prefill", prefill), ("decode_only", ~prefill))
        },
        "tail": tail(run.finished_at, run.seconds),
        "batch_over_time": batch_over_time(run, shapes, bounds),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_cached": sum(f.num_cached_tokens for f in run.finished),
        "prompt_tokens_distinct": sum(distinct.values()),
        "preemptions": run.preemptions,
    }


def print_summary(name: str, figures: dict, kv: dict) -> None:
    f, t, p = figures, figures["tail"], figures["phases"]
    tag = f"[{name} grpo]"
    print(
        f"{tag} {f['requests']:,} requests, {f['prompt_tokens']:,} prompt + "
        f"{f['output_tokens']:,} output tokens; KV cache {kv['tokens']:,} tokens "
        f"({kv['blocks']:,} blocks of {kv['block_size']}) at --gpu-memory-utilization "
        f"{kv['gpu_memory_utilization']}"
    )
    print(
        f"{tag} {f['seconds']:.1f} s, {f['output_tok_s']:,.0f} output tok/s; the steps' bounds "
        f"sum to {f['bound_s']:.1f} s (prefill-carrying steps {p['with_prefill']['bound_s']:.1f}, "
        f"decode-only {p['decode_only']['bound_s']:.1f}): {f['wall_over_bound']:.2f}x of the bound"
    )
    print(
        f"{tag} tail: the last {t['requests']} requests ran {t['seconds']:.1f} s after "
        f"{TAIL_SHARE:.0%} had finished, {t['share_of_run']:.1%} of the run"
    )
    shareable = f["prompt_tokens"] - f["prompt_tokens_distinct"]
    print(
        f"{tag} prefix cache served {f['prompt_tokens_cached']:,} of {f['prompt_tokens']:,} "
        f"prompt tokens ({shareable:,} repeat an earlier request's prompt); "
        f"{f['preemptions']} preemptions; {f['flop_bound_steps']:,} of {f['steps']:,} steps "
        "FLOP-bound"
    )
    print(
        "\n| seconds | steps | seqs a step | tokens a step | output tok/s | bound / wall | finished |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in f["batch_over_time"]:
        print(
            f"| {row['from_s']:.2f}-{row['to_s']:.2f} | {row['steps']:,} | "
            f"{row['seqs_per_step']:.1f} | {row['tokens_per_step']:.1f} | "
            f"{row['output_tok_s']:,.0f} | {row['bound_share']:.2f} | {row['finished']:,} |"
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="olmoe-1b-7b", help="name under benchmarks/configs")
    workloads.add_workload_arguments(parser, num_prompts=128, choices=workloads.WORKLOADS)
    parser.set_defaults(workload="grpo", prompt_len=1024, output_range="256-8192")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    parser.add_argument("--no-logprobs", dest="logprobs", action="store_false")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--warmup-tokens", type=int, default=4, help="output tokens of the unmeasured warm-up"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    small = {} if dev.type == "cuda" else {"copy_bytes": 16 << 20, "matmul_size": 256}
    rates = step_bounds.measure_rates(dev, dtype, **small)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke test)"
    print(
        f"# {gpu}, torch {torch.__version__}: matmul {rates.flops_per_s / 1e12:.3g} TFLOP/s "
        f"({str(dtype).removeprefix('torch.')}), copy {rates.bytes_per_s / 1e12:.3g} TB/s",
        flush=True,
    )
    prompts, output_lens = workloads.prompts(args, config["vocab_size"])
    max_model_len = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = load_model(
            tmp, device=dev, dtype=str(dtype).removeprefix("torch."), load_format="dummy"
        ).model
    configure_cpu_threads(model, dev)  # as a record run does: one thread for a tiny model
    t0 = time.perf_counter()
    engine = build_engine(model, args, max_model_len)
    setup_s = time.perf_counter() - t0
    warm_args = argparse.Namespace(**{**vars(args), "workload_seed": args.workload_seed + 1000})
    warm_prompts, _ = workloads.prompts(warm_args, config["vocab_size"])
    warm = run_rollouts(engine, warm_prompts, [args.warmup_tokens] * len(warm_prompts), args)
    run = run_rollouts(engine, prompts, output_lens, args)
    assert sum(f.output_len for f in run.finished) == sum(output_lens)
    bs = engine.config.block_size
    kv = {
        "tokens": engine.block_manager.num_blocks * bs,
        "blocks": engine.block_manager.num_blocks,
        "block_size": bs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        # plan_num_blocks never sizes past every sequence at the longest length
        "capped": engine.block_manager.num_blocks
        == args.max_num_seqs * -(-engine.max_model_len // bs),
    }
    figures = summarise(
        run, step_shapes(run, model.num_experts), step_bounds.model_costs(model), rates
    )
    print_summary(args.config, figures, kv)
    if args.out:
        result = {
            "env": {
                "gpu": gpu,
                "torch": torch.__version__,
                "matmul_flops_per_s": rates.flops_per_s,
                "copy_bytes_per_s": rates.bytes_per_s,
                "args": {k: v for k, v in vars(args).items() if k != "out"},
            },
            "config": args.config,
            "engine_setup_s": setup_s,
            "startup": engine.startup.seconds,
            "warmup_s": warm.seconds,
            "kv_cache": kv,
            **figures,
        }
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
