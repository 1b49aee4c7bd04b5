"""What capturing gate weights costs: the same workload with routing capture off, ids only,
ids + float16 weights and ids + float32 weights, engines alternating, on one GPU.

Dummy weights in the shapes of real checkpoints (``benchmarks/configs``), greedy,
EOS ignored.  Besides end-to-end output tokens/s it times one graph-replayed
decode step per engine (the device-side cost alone).

    python benchmarks/weights_capture.py --config olmoe-1b-7b --config qwen3-30b-a3b

Prints a table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.models.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
import workloads  # noqa: E402
from throughput import CONFIGS, decode_step_profile, device, run_batch  # noqa: E402

# mode -> (capture routing, weights dtype)
MODES = {
    "no-capture": (False, None),
    "ids": (True, None),
    "ids+float16": (True, "float16"),
    "ids+float32": (True, "float32"),
}


def make_engine(model, mode: str, args, num_blocks: int) -> LLMEngine:
    capture, weights = MODES[mode]
    config = EngineConfig(
        capture_routing=capture,
        capture_weights=weights,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=False,
    )
    return LLMEngine(model, config, device())


def bench(name: str, config: dict, args) -> dict:
    prompts, output_lens = workloads.prompts(args, config["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        dtype = "bfloat16" if device().type == "cuda" else "float32"
        model = load_model(tmp, device=device(), dtype=dtype, load_format="dummy").model
    tokens_per_seq = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    num_blocks = args.max_num_seqs * -(-tokens_per_seq // 16) + 64
    engines = {mode: make_engine(model, mode, args, num_blocks) for mode in MODES}
    plans = {
        mode: workloads.keep_last_plans(e.runner.graphs) if e.runner.graphs else {}
        for mode, e in engines.items()
    }
    for engine in engines.values():  # compile and warm every step shape first
        run_batch(engine, prompts, [args.warmup_tokens] * len(prompts))
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(engines.items())
    for repeat in range(args.repeats):
        for mode, engine in order[repeat % len(order) :] + order[: repeat % len(order)]:
            tok_s = run_batch(engine, prompts, output_lens)["tok_s"]
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in args.config or ["olmoe-1b-7b", "qwen3-30b-a3b"]:
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
