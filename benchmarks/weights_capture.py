"""What recording gate weights and log-probs costs: one workload recorded with routing capture
off, ids only, ids + float16 or float32 gate weights (``--record-weights``), ids + log-probs
(``--logprobs``) and ids + float16 weights + log-probs, engines alternating, on one GPU.

Dummy weights in the shapes of real checkpoints (``benchmarks/configs``), greedy,
EOS ignored.  Each run records as ``moetrace record`` does: finished requests go
to a trace writer (HDF5, its background thread) holding what the mode captures,
and the run ends when the trace is closed (capture off writes none; ``--no-trace``
times the engine alone).
Besides end-to-end output tokens/s it times one graph-replayed decode step per
engine (the device-side cost alone; log-probs are computed after the graph, so
their step time is the ids' one).

    python benchmarks/weights_capture.py --config olmoe-1b-7b
    python benchmarks/weights_capture.py --config tiny-qwen3 --num-prompts 8 --repeats 1  # CPU smoke

Prints a table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import load_model
from moetrace.runs.setup import model_metadata
from moetrace.trace.writer import TraceWriter

sys.path.insert(0, str(Path(__file__).parent))
import workloads  # noqa: E402
from throughput import CONFIGS, decode_step_profile, device, sync  # noqa: E402

# mode -> (capture routing, gate weights dtype, log-probs)
MODES = {
    "no-capture": (False, None, False),
    "ids": (True, None, False),
    "ids+float16": (True, "float16", False),
    "ids+float32": (True, "float32", False),
    "ids+logprobs": (True, None, True),
    "ids+float16+logprobs": (True, "float16", True),
}


def make_engine(model, mode: str, args, num_blocks: int) -> LLMEngine:
    capture, weights, _ = MODES[mode]
    config = EngineConfig(
        capture_routing=capture,
        capture_weights=weights,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=False,
    )
    return LLMEngine(model, config, device())


def record(engine: LLMEngine, source, mode: str, prompts, output_lens, trace: Path | None) -> float:
    """Output tokens/s of one recording of the workload, the trace closed at the end."""
    capture, _, logprobs = MODES[mode]
    writer = None
    if trace is not None and capture:
        metadata = model_metadata(source, engine, None, engine.config.to_dict(), logprobs=logprobs)
        writer = TraceWriter(trace, metadata, overwrite=True)
        writer.start()
    sync()
    start = time.perf_counter()
    for i, (ids, n) in enumerate(zip(prompts, output_lens, strict=True)):
        params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0 if logprobs else None)
        engine.add_request(f"r{i}", ids, params, index=i)
    tokens = 0
    while engine.has_unfinished():
        for done in engine.step():
            tokens += done.output_len
            if writer is not None:
                writer.submit(done)
    sync()
    if writer is not None:
        writer.close(complete=True, end_reason="complete")
    assert tokens == sum(output_lens)
    return tokens / (time.perf_counter() - start)


def bench(name: str, config: dict, args) -> dict:
    prompts, output_lens = workloads.prompts(args, config["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        dtype = "bfloat16" if device().type == "cuda" else "float32"
        loaded = load_model(tmp, device=device(), dtype=dtype, load_format="dummy")
        model = loaded.model
    model.architecture = config["architectures"][0]
    tokens_per_seq = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    num_blocks = args.max_num_seqs * -(-tokens_per_seq // 16) + 64
    engines = {mode: make_engine(model, mode, args, num_blocks) for mode in MODES}
    plans = {
        mode: workloads.keep_last_plans(e.runner.graphs) if e.runner.graphs else {}
        for mode, e in engines.items()
    }
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(dir=args.trace_dir) as tmp:
        trace = None if args.no_trace else Path(tmp) / "bench.h5"
        for mode, engine in engines.items():  # compile and warm every step shape first
            record(engine, loaded.source, mode, prompts, [args.warmup_tokens] * len(prompts), trace)
        order = list(engines.items())
        for repeat in range(args.repeats):
            for mode, engine in order[repeat % len(order) :] + order[: repeat % len(order)]:
                tok_s = record(engine, loaded.source, mode, prompts, output_lens, trace)
                runs[mode].append(tok_s)
                print(f"[{name}] {mode}: {tok_s:,.0f} tok/s", flush=True)
    batch = min(args.max_num_seqs, len(prompts))
    result = {"runs": runs, "median": {m: statistics.median(r) for m, r in runs.items()}}
    result["decode_step_ms"] = {
        mode: decode_step_profile(engine, model, batch, plans[mode]).get("step_ms")
        for mode, engine in engines.items()
    }
    del engines, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="name under benchmarks/configs")
    workloads.add_workload_arguments(parser, num_prompts=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=4, help="runs per engine, rotating order")
    parser.add_argument("--warmup-tokens", type=int, default=2)
    parser.add_argument("--no-trace", action="store_true", help="time the engine alone")
    parser.add_argument("--trace-dir", default=None, help="where the traces are written (tmp)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in args.config or ["olmoe-1b-7b"]:
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        results[name] = bench(name, config, args)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
    print("\n| config | mode | output tok/s (median) | vs ids only | decode step ms @B |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if name == "gpu":
            continue
        base = r["median"]["ids"]
        for mode, tok_s in r["median"].items():
            step = r["decode_step_ms"][mode]
            step_text = "-" if step is None else f"{step:.3f}"
            print(f"| {name} | {mode} | {tok_s:,.0f} | {tok_s / base:.3f} | {step_text} |")


if __name__ == "__main__":
    main()
