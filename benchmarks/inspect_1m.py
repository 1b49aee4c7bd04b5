"""Time ``moetrace inspect`` on a large generated trace and show its memory stays bounded.

Writes a valid trace (the layout of docs/trace-format.md, real checksums)
straight with h5py: ``--rows`` routing rows of ``--layers`` x ``--top-k``
expert ids over ``--experts`` experts (default: Qwen3-30B-A3B's 48 x 8 of
128, 1,000,000 rows, 384 MB of ids), with a skewed load so the figures are
not trivial.  Then runs each inspect command in its own process under
``/usr/bin/time -v`` and reports wall time and peak RSS, beside the peak RSS
of ``moetrace --version`` (the interpreter and imports alone).

    python benchmarks/inspect_1m.py --out /tmp/bench   # keeps /tmp/bench/trace.h5

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import h5py
import numpy as np

from moetrace.trace.metadata import LIBVER, expert_id_dtype
from moetrace.trace.records import REQUEST_DTYPE, ROUTED_EXPERTS, TOKEN_IDS

GEN_ROWS = 65536  # rows generated and written at a time


def make_trace(
    path: Path,
    rows: int = 1_000_000,
    layers: int = 48,
    experts: int = 128,
    top_k: int = 8,
    requests: int = 2000,
    seed: int = 0,
) -> np.ndarray:
    """Write the trace; returns the expected ``(layers, experts)`` selection counts."""
    rng = np.random.default_rng(seed)
    dtype = expert_id_dtype(experts)
    # Request lengths summing to ``rows``; each finished normally (rows = tokens - 1).
    cuts = np.sort(rng.choice(np.arange(1, rows), requests - 1, replace=False))
    num_rows = np.diff(np.concatenate([[0], cuts, [rows]]))
    prompt_len = np.maximum(1, (num_rows * rng.uniform(0.3, 0.9, requests)).astype(np.int64))
    output_len = num_rows + 1 - prompt_len
    # Skewed popularity per layer; top-k ids distinct by construction: base + fixed offsets.
    weights = rng.random((layers, experts)) ** 3 + 0.02
    probs = weights / weights.sum(axis=1, keepdims=True)
    offsets = np.cumsum(np.arange(top_k)) % experts
    if len(set(offsets.tolist())) != top_k:
        offsets = np.arange(top_k)
    counts = np.zeros((layers, experts), dtype=np.int64)
    with h5py.File(path, "w", libver=LIBVER) as f:
        routed = f.create_dataset(
            ROUTED_EXPERTS, (rows, layers, top_k), dtype=dtype.newbyteorder("<"),
            chunks=(1024, layers, top_k), maxshape=(None, layers, top_k),
        )  # fmt: skip
        tokens = f.create_dataset(
            TOKEN_IDS, (rows + requests,), dtype="<i4", chunks=(16384,), maxshape=(None,)
        )
        for start in range(0, rows, GEN_ROWS):
            n = min(GEN_ROWS, rows - start)
            base = np.stack([rng.choice(experts, n, p=probs[i]) for i in range(layers)], 1)
            block = ((base[:, :, None] + offsets) % experts).astype(dtype)
            routed[start : start + n] = block
            for i in range(layers):
                counts[i] += np.bincount(block[:, i].ravel(), minlength=experts)
        for start in range(0, rows + requests, GEN_ROWS):
            n = min(GEN_ROWS, rows + requests - start)
            tokens[start : start + n] = rng.integers(0, 32000, n, dtype=np.int32)
        row_start = np.concatenate([[0], np.cumsum(num_rows)[:-1]])
        token_start = np.concatenate([[0], np.cumsum(num_rows + 1)[:-1]])
        table = np.zeros(requests, dtype=REQUEST_DTYPE)
        table["id"] = [f"req-{i}" for i in range(requests)]
        table["index"] = np.arange(requests)
        table["prompt_len"], table["output_len"] = prompt_len, output_len
        table["num_rows"], table["row_start"], table["token_start"] = (
            num_rows,
            row_start,
            token_start,
        )
        table["finish_reason"] = 1  # length
        for name in REQUEST_DTYPE.names:  # every string column (extra, stop_reason, ...) empty
            if REQUEST_DTYPE[name].kind == "O" and name != "id":
                table[name] = ""
        for i in range(requests):
            r0, t0 = int(row_start[i]), int(token_start[i])
            crc = zlib.crc32(routed[r0 : r0 + num_rows[i]].tobytes())
            table["checksum"][i] = zlib.crc32(tokens[t0 : t0 + num_rows[i] + 1].tobytes(), crc)
        f.create_dataset("requests", data=table, chunks=(1024,), maxshape=(None,))
        f.attrs.update(
            {
                "format": "moetrace-trace",
                "format_version": 1,
                "model": "synthetic",
                "architecture": "SyntheticMoeForCausalLM",
                "config_digest": "0" * 64,
                "num_hidden_layers": layers,
                "num_moe_layers": layers,
                "moe_layer_indices": np.arange(layers, dtype=np.int64),
                "num_experts": experts,
                "top_k": top_k,
                "vocab_size": 32000,
                "tokenizer": "",
                "dtype": "bfloat16",
                "expert_id_dtype": dtype.name,
                "row_order": "router",
                "engine_settings": "{}",
                "moetrace_version": "benchmark",
                "created": "2025-01-01T00:00:00Z",
                "complete": True,
                "num_requests": requests,
                "num_rows": rows,
                "num_tokens": rows + requests,
            }
        )
    return counts


def measure(args: list[str]) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS (MiB) and stdout of one command."""
    proc = subprocess.run(
        ["/usr/bin/time", "-v", *args], capture_output=True, text=True, check=True
    )
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr)
    parts = [float(x) for x in wall.group(1).split(":")]
    seconds = sum(p * 60**i for i, p in enumerate(reversed(parts)))
    cpu = sum(
        float(re.search(rf"{name} time \(seconds\): ([\d.]+)", proc.stderr).group(1))
        for name in ("User", "System")
    )
    return seconds, cpu, rss_kb / 1024, proc.stdout


def read_all_rows(trace: Path, verify: bool) -> float:
    """CPU seconds to stream every row of the trace, each request's checksum checked or not."""
    from moetrace import open_trace

    start = time.process_time()
    with open_trace(trace, verify=verify) as t:
        for _ in t.iter_row_chunks():
            pass
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/moetrace-bench"))
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--reuse", action="store_true", help="Keep an existing OUT/trace.h5.")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / "trace.h5"
    t0 = time.perf_counter()
    if args.reuse and trace.exists():
        from moetrace import open_trace
        from moetrace.trace.stats import expert_counts

        with open_trace(trace) as t:
            counts = expert_counts(t)
    else:
        counts = make_trace(trace, args.rows, args.layers, args.experts, args.top_k, args.requests)
    made = time.perf_counter() - t0
    size = trace.stat().st_size / 2**20
    exe = [sys.executable, "-m", "moetrace"]
    commands = {
        "moetrace --version (imports only)": [*exe, "--version"],
        "moetrace inspect trace.h5 --json": [*exe, "inspect", str(trace), "--json"],
        "moetrace inspect trace.h5 --json --no-verify-checksums": [
            *exe, "inspect", str(trace), "--json", "--no-verify-checksums",
        ],
        "moetrace inspect trace.h5 --all --ep-size 8 --json": [
            *exe, "inspect", str(trace), "--all", "--ep-size", "8", "--json",
        ],
    }  # fmt: skip
    print(f"trace: {args.rows:,} rows x {args.layers} layers x top-{args.top_k} of "
          f"{args.experts} experts, {args.requests:,} requests, {size:,.0f} MiB "
          f"(ready in {made:.1f} s)\n")  # fmt: skip
    print("| command | wall time | CPU time | peak RSS |\n|---|---:|---:|---:|")
    for name, cmd in commands.items():
        seconds, cpu, rss, out = measure(cmd)
        if "inspect" in name:
            got = json.loads(out)["expert_counts"]
            assert got == counts.tolist(), "inspect counts differ from the generated ones"
        print(f"| `{name}` | {seconds:.1f} s | {cpu:.1f} s | {rss:,.0f} MiB |")
    print("\nReading every row in this process (Trace.iter_row_chunks), CPU seconds, best of 3:\n")
    print("| checksums | CPU time | rows/s |\n|---|---:|---:|")
    for verify in (True, False):
        best = min(read_all_rows(trace, verify) for _ in range(3))
        label = "checked as read (default)" if verify else "not checked (verify=False)"
        print(f"| {label} | {best:.2f} s | {args.rows / best:,.0f} |")
    load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout
    print(f"\nload average during the run: {load.split()[0]} (1 min)")


if __name__ == "__main__":
    main()
