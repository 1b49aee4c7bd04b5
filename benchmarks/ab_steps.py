"""``throughput.py`` in fresh processes, one a variant and round, its figures side by side.

    mkdir -p out/old && git archive 882c7eb moetrace benchmarks | tar -x -C out/old
    python benchmarks/ab_steps.py --variant old@out/old= --variant new= --rounds 2 -- \\
        --config gpt-oss-20b --num-prompts 256 --output-len 64 --hf '' --repeats 1 --warmup-tokens 32

A variant is ``LABEL[@TREE]=[NAME=VALUE[,NAME=VALUE...]]``: environment settings
for its processes and, with ``@TREE``, another source tree to run (a commit
unpacked by ``git archive``), whose ``benchmarks/throughput.py`` runs with the
tree first on ``PYTHONPATH``; an older tree's own switches are set that way.
Everything after ``--`` goes to every ``throughput.py``.  Each round runs
every variant once in a process of its own, the order
reversed on odd rounds, so that a first-run cost or a machine's drift weighs
on all alike.  A table per config follows: each variant's output tok/s with
capture (and on/off), its batch decode step with and without capture, the HBM
bound of that step and the ratio, medians over the rounds with each round's
figure beside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent


class Variant(NamedTuple):
    label: str
    tree: Path | None  # another source tree; None: this one
    env: dict[str, str]


def parse_variant(text: str) -> Variant:
    """``LABEL[@TREE]=[NAME=VALUE[,NAME=VALUE...]]`` as a ``Variant``."""
    head, sep, settings = text.partition("=")
    if not sep or not head:
        raise argparse.ArgumentTypeError(f"{text!r}: want LABEL[@TREE]=[NAME=VALUE,...]")
    label, _, tree = head.partition("@")
    env = {}
    for item in filter(None, settings.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{text!r}: setting {item!r} is not NAME=VALUE")
        env[name] = value
    root = Path(tree).resolve() if tree else None
    if root is not None and not (root / "benchmarks" / "throughput.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: {root} has no benchmarks/throughput.py")
    return Variant(label, root, env)


def run_one(variant: Variant, round_no: int, passed: list[str]) -> dict | None:
    """One ``throughput.py`` process of ``variant``: its JSON figures, or None if it failed."""
    root = variant.tree or HERE.parent
    env = {**os.environ, **variant.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [
            sys.executable,
            str(root / "benchmarks" / "throughput.py"),
            *passed,
            "--out",
            str(out),
        ]
        print(f"## {variant.label}, round {round_no}: {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, env=env, check=False)
        if done.returncode != 0 or not out.is_file():
            print(f"## {variant.label}, round {round_no}: exit {done.returncode}", flush=True)
            return None
        return json.loads(out.read_text())


def figures(result: dict, name: str) -> dict[str, float]:
    """One config's figures from one run's JSON (NaN where a run has none)."""
    nan = float("nan")
    r = result["configs"][name]
    on, off = r["moetrace"]["capture"]["median"], r["moetrace"]["no-capture"]["median"]
    prof = r.get("decode_profile") or {}
    prof_off = r.get("decode_profile_no_capture") or {}
    hbm = result["env"]["hbm_bytes_per_s"]
    bytes_ = prof.get("weight_bytes", 0) + prof.get("kv_bytes", 0)
    bound = bytes_ / hbm * 1e3 if bytes_ and not math.isnan(hbm) else nan
    step = prof.get("step_ms", nan)
    return {
        "tok_s": on,
        "on_off": on / off,
        "step_ms": step,
        "step_off_ms": prof_off.get("step_ms", nan),
        "bound_ms": bound,
        "ratio": step / bound,
    }


def print_tables(results: dict[str, list[dict]]) -> None:
    """A table per config: each variant's medians over its rounds, each round beside."""
    names = sorted({n for runs in results.values() for run in runs for n in run["configs"]})
    columns = [
        ("capture tok/s", "tok_s", "{:,.0f}"),
        ("on/off", "on_off", "{:.3f}"),
        ("decode step, capture (ms)", "step_ms", "{:.3f}"),
        ("no capture (ms)", "step_off_ms", "{:.3f}"),
        ("HBM bound (ms)", "bound_ms", "{:.2f}"),
        ("ratio", "ratio", "{:.3f}x"),
    ]
    for name in names:
        print(f"\n{name}\n")
        print("| variant | " + " | ".join(title for title, _, _ in columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for label, runs in results.items():
            rows = [figures(run, name) for run in runs if name in run["configs"]]
            if not rows:
                print(f"| {label} | " + " | ".join("failed" for _ in columns) + " |")
                continue
            cells = []
            for _, key, fmt in columns:
                values = [row[key] for row in rows]
                each = " · ".join(fmt.format(v) for v in values)
                median = fmt.format(statistics.median(values))
                cells.append(median if len(values) == 1 else f"{median} ({each})")
            print(f"| {label} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        required=True,
        help="LABEL[@TREE]=[NAME=VALUE,...] (repeatable)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv[:split])
    passed = argv[split + 1 :]
    labels = [v.label for v in args.variant]
    if len(set(labels)) != len(labels):
        parser.error(f"variant labels repeat: {labels}")
    results: dict[str, list[dict]] = {v.label: [] for v in args.variant}
    for round_no in range(args.rounds):
        order = args.variant if round_no % 2 == 0 else args.variant[::-1]
        for variant in order:
            result = run_one(variant, round_no, passed)
            if result is not None:
                results[variant.label].append(result)
    print_tables(results)


if __name__ == "__main__":
    main()
