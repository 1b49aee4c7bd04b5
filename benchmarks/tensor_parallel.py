"""Throughput and scaling of ``moetrace record --tensor-parallel-size N``, and trace agreement.

Runs the real command once per group size on dummy weights in a real
checkpoint's shape, greedy with EOS ignored, and reports output tokens/s
(the recording loop only, as the command's summary line gives it), the
speed-up over one GPU, and how each trace compares with the TP=1 trace:
requests with identical tokens, and the share of routing rows equal per
layer.  NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

    python benchmarks/tensor_parallel.py --config qwen3-30b-a3b --tp 1 2 4

Prints a markdown table for docs/benchmarks.md and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from moetrace import open_trace

CONFIGS = Path(__file__).parent / "configs"
SUMMARY = re.compile(r"in ([\d.]+) s \(([\d,]+) output tok/s\)")


def record(
    model: Path, prompts: Path, out: Path, tp: int, args: argparse.Namespace, eager: bool = False
) -> dict:
    cmd = [sys.executable, "-m", "moetrace", "record", str(model), str(prompts), "-o", str(out)]
    cmd += ["--load-format", "dummy", "--dtype", args.dtype, "--ignore-eos", "-q", "--overwrite"]
    cmd += ["--max-tokens", str(args.output_len), "--max-num-seqs", str(args.max_num_seqs)]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp), *args.flags]
    if eager:
        cmd += ["--enforce-eager"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"TP={tp} failed:\n{proc.stderr}")
    seconds, rate = SUMMARY.search(proc.stderr).groups()
    rate = float(rate.replace(",", ""))
    return {"tp": tp, "eager": eager, "seconds": float(seconds), "tok_s": rate}


def compare(reference: Path, other: Path) -> dict:
    with open_trace(reference) as a, open_trace(other) as b:
        want = {r.id: r for r in a}
        got = {r.id: r for r in b}
    same_tokens = sum(
        np.array_equal(want[k].output_token_ids, got[k].output_token_ids) for k in want
    )
    # Rows up to where the generations part compare like for like.
    agree = []
    for k, r in want.items():
        n = min(r.routed_experts.shape[0], got[k].routed_experts.shape[0])
        if not np.array_equal(r.output_token_ids, got[k].output_token_ids):
            first = int(np.argmax(r.output_token_ids != got[k].output_token_ids))
            n = min(n, len(r.prompt_token_ids) + first)
        agree.append((r.routed_experts[:n] == got[k].routed_experts[:n]).all(axis=-1))
    per_layer = np.concatenate(agree).mean(axis=0)
    return {
        "requests_same_tokens": f"{same_tokens}/{len(want)}",
        "min_layer_row_agreement": float(per_layer.min()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="Keep only the first N layers.")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--flags", nargs="*", default=[], help="e.g. --enable-expert-parallel")
    parser.add_argument(
        "--eager-too", action="store_true", help="Also run each size with --enforce-eager."
    )
    parser.add_argument("--out", type=Path, default=Path("tensor_parallel.json"))
    args = parser.parse_args()

    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    if args.layers:
        config["num_hidden_layers"] = args.layers
    with tempfile.TemporaryDirectory(prefix="moetrace-tp-bench-") as tmp:
        model = Path(tmp) / args.config
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        rng = np.random.default_rng(0)
        vocab = int(config["vocab_size"])
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps(
                    {"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
                )
                + "\n"
                for _ in range(args.num_prompts)
            )
        )
        rows = []
        reference = Path(tmp) / f"tp{args.tp[0]}.h5"
        for tp in args.tp:
            for eager in (False, True) if args.eager_too else (False,):
                out = Path(tmp) / f"tp{tp}{'-eager' if eager else ''}.h5"
                row = record(model, prompts, out, tp, args, eager)
                if out != reference:
                    row |= compare(reference, out)
                rows.append(row)
    base = rows[0]["tok_s"]
    print("| TP | decode | output tok/s | speed-up | same tokens | min layer row agreement |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        agree = r.get("min_layer_row_agreement")
        print(
            f"| {r['tp']} | {'eager' if r['eager'] else 'graphs'} | {r['tok_s']:,.0f} | "
            f"{r['tok_s'] / base:.2f}x | "
            f"{r.get('requests_same_tokens', '-')} | {'-' if agree is None else f'{agree:.4f}'} |"
        )
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
