"""A user's first ``moetrace record`` on a fresh machine against the second, end to end.

Runs the real command line twice in fresh processes on the same job (dummy
weights of a real config's shape, token-id prompts, EOS ignored): the first
with an empty Triton cache, as on a machine that never ran moetrace, the
second with the cache the first one left.  Reports each run's wall time
(process start to exit), its start-up and its output tok/s, and the ratio.

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
        for name in ("first", "second"):
            runs[name] = record(model, prompts, tmp / f"{name}.h5", cache, args.record_args)
            r = runs[name]
            print(
                f"[{args.config} {args.workload}] {name} run: {r['wall_s']:.1f} s wall, "
                f"start-up {r['startup_s']} s ({r['startup']}), {r['tok_s']:,.0f} tok/s",
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
