"""A user's first ``moetrace record`` on a fresh machine against the second, end to end.

Runs the real command line twice in fresh processes on the same job (dummy
weights of a real config's shape, token-id prompts, EOS ignored): the first
with an empty Triton cache, as on a machine that never ran moetrace, the
second with the cache the first one left.  Reports each run's wall time
(process start to exit), its start-up and its output tok/s, the ratio, and what
each run added to the cache.

Everything a run keeps on disk lives under ``TRITON_CACHE_DIR``: Triton's compiled
kernels and their C launchers, a folder each, filed under Triton's hash of the
kernel's source and of every jit function it calls, its compile-time constants,
options, Triton's version and the GPU; and beside them, in ``moetrace-variants/``,
moetrace's list of the variants a run's step sizes launch
(``moetrace/engine/precompile.py``'s ``variants_key``).  A second run that adds
entries compiled something the first did not leave behind.

    python benchmarks/first_run.py --config olmoe-1b-7b --num-prompts 2048
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import workloads  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
VARIANT_LISTS = "moetrace-variants"  # moetrace's folder inside Triton's cache


def write_job(tmp: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    prompts, output_lens = workloads.prompts(args, config["vocab_size"])
    lines = [
        json.dumps({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": n})
        for i, (ids, n) in enumerate(zip(prompts, output_lens, strict=True))
    ]
    path = tmp / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return model, path


def record(model: Path, prompts: Path, out: Path, cache: Path, extra: list[str]) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "moetrace", "record", str(model), str(prompts)]
    command += ["-o", str(out), "--load-format", "dummy", "--ignore-eos", "--overwrite", *extra]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"record failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rate = re.search(r"\(([\d,]+) output tok/s\)", done.stderr)
    startup = re.search(r"start-up ([\d.]+) s: (.*)", done.stderr)
    return {
        "wall_s": wall,
        "tok_s": float(rate.group(1).replace(",", "")) if rate else None,
        "startup_s": float(startup.group(1)) if startup else None,
        "startup": startup.group(2) if startup else "",
    }


def cache_inventory(cache: Path) -> dict:
    """Triton's entries (compiled kernels and launchers, a folder each), every file's
    bytes, and moetrace's variant lists, in the cache folder ``cache``."""
    if not cache.is_dir():
        return {"entries": 0, "bytes": 0, "variant_lists": 0}
    return {
        "entries": sum(1 for p in cache.iterdir() if p.is_dir() and p.name != VARIANT_LISTS),
        "bytes": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()),
        "variant_lists": len(list((cache / VARIANT_LISTS).glob("*.json"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="olmoe-1b-7b")
    workloads.add_workload_arguments(parser, num_prompts=2048)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("record_args", nargs="*", help="extra `moetrace record` options")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model, prompts = write_job(tmp, args)
        cache = tmp / "triton-cache"
        runs = {}
        before = cache_inventory(cache)
        for name in ("first", "second"):
            runs[name] = record(model, prompts, tmp / f"{name}.h5", cache, args.record_args)
            r = runs[name]
            r["cache"] = cache_inventory(cache)
            added = r["cache"]["entries"] - before["entries"]
            before = r["cache"]
            print(
                f"[{args.config} {args.workload}] {name} run: {r['wall_s']:.1f} s wall, "
                f"start-up {r['startup_s']} s ({r['startup']}), {r['tok_s']:,.0f} tok/s; "
                f"the Triton cache gained {added} entries (now {r['cache']['entries']}, "
                f"{r['cache']['bytes'] / 1e6:.1f} MB, {r['cache']['variant_lists']} variant "
                "lists)",
                flush=True,
            )
    ratio = runs["first"]["wall_s"] / runs["second"]["wall_s"]
    print(f"[{args.config} {args.workload}] first / second wall time: {ratio:.2f}x", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": None}, "runs": runs}, indent=2)
        )


if __name__ == "__main__":
    main()
