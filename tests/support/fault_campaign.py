"""The fault campaign behind docs/reliability.md's table: many runs of each fault, counted.

    OMP_NUM_THREADS=1 python tests/support/fault_campaign.py            # about 10-20 min on 2 cores
    OMP_NUM_THREADS=1 python tests/support/fault_campaign.py --quick    # a few runs of each, ~2 min

Not collected by pytest (the tests are the fast, fixed-seed versions of the
same checks).  Each fault is injected into real ``moetrace record`` processes
of a tiny checkpoint (dummy weights) or into finished trace files; every
recovered trace is compared request by request with an uninterrupted run.
Prints a markdown table.  Needs root and tmpfs for the disk-full rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from moetrace.errors import MoetraceError  # noqa: E402
from moetrace.trace.diskspace import RESERVE_ENV  # noqa: E402
from moetrace.trace.verify import verify_guarded, verify_trace  # noqa: E402
from support.reliability import (  # noqa: E402
    ENV,
    popen,
    record_args,
    requests_by_id,
    run_cli,
    tiny_checkpoint,
    token_prompts,
    write_jsonl,
)


class _Rows(list):
    """Rows of the table, each also printed as soon as it is known."""

    def append(self, row: tuple) -> None:
        super().append(row)
        print("| " + " | ".join(str(x) for x in row) + " |", file=sys.stderr, flush=True)


ROWS: list[tuple] = _Rows()  # (fault, tried, outcome, recovered, rows lost)


def compare(final: Path, reference: dict) -> tuple[int, int]:
    """(requests equal to the reference, reference rows missing or different in ``final``)."""
    got = requests_by_id(final)
    same, lost = 0, 0
    for rid, (tokens, rows, reason) in reference.items():
        mine = got.get(rid)
        ok = (
            mine is not None
            and np.array_equal(mine[0], tokens)
            and np.array_equal(mine[1], rows)
            and mine[2] == reason
        )
        same += ok
        lost += 0 if ok else len(rows)
    return same, lost


def flushed(path: Path) -> int:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return int(f.attrs["num_requests"])
    except (OSError, KeyError):
        return -1


def signal_runs(kind: str, sig: int, runs: int, setup: dict, rng: random.Random) -> None:
    model, prompts, reference = setup["model"], setup["prompts"], setup["reference"]
    outcomes: Counter = Counter()
    kept_total = recovered = lost_total = 0
    for i in range(runs):
        out = setup["tmp"] / f"{kind}-{i}.h5"
        extra = (
            "--max-num-seqs",
            str(rng.choice([1, 2, 4, 16])),
            "--flush-every",
            str(rng.choice([1, 3, 8, 64])),
            "--flush-interval",
            str(rng.choice([0.05, 0.2, 1.0])),
        )
        proc = popen(*record_args(model, prompts, out, "--max-tokens", "4", *extra))
        target = rng.randint(0, len(reference) - 20)  # stop somewhere in the run, anywhere
        while flushed(out) < target and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
        want = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -9}[sig]
        if proc.returncode == 0:
            outcomes["finished before the signal"] += 1
        elif proc.returncode != want:
            outcomes[f"exit {proc.returncode} (expected {want})"] += 1
        if sig != signal.SIGKILL and proc.returncode == want:
            last = stderr.strip().splitlines()[-1]
            if not last.startswith("error: interrupted by"):
                outcomes["summary line missing"] += 1
        if not out.exists():  # stopped before the trace existed: nothing to keep
            outcomes["stopped before the file existed"] += 1
            print(
                f"{kind} run {i}: exit {proc.returncode}, no file: {stderr[-300:]}", file=sys.stderr
            )
        else:
            report = verify_trace(out)
            outcomes[f"file {report.status}"] += 1
            kept_total += report.num_requests
            print(f"{kind} run {i}: exit {proc.returncode}, {report.summary()}", file=sys.stderr)
        code, _, err = run_cli(*record_args(model, prompts, out, "--max-tokens", "4", "--resume"))
        if code != 0:
            outcomes[f"resume failed: {err.strip()[:80]}"] += 1
            continue
        same, lost = compare(out, reference)
        recovered += same
        lost_total += lost
        if verify_trace(out).status != "ok":
            outcomes["resumed file not ok"] += 1
    n = len(reference)
    ROWS.append(
        (
            f"{kind} at a random point of a `record` run (after 0-380 of 400 requests flushed)",
            f"{runs} runs",
            _fmt(outcomes) + f"; {kept_total} requests kept in the stopped files",
            f"{recovered} / {runs * n} after `--resume`",
            lost_total,
        )
    )


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_kib: int):
    directory.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(directory)]
    ).returncode:
        raise RuntimeError("cannot mount tmpfs (needs root)")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=False)


def disk_full_runs(runs: int, reserve: bool, setup: dict, rng: random.Random) -> None:
    model, prompts, reference = setup["model"], setup["prompts"], setup["reference"]
    size = setup["reference_path"].stat().st_size
    outcomes: Counter = Counter()
    kept_total = recovered = lost_total = 0
    env = dict(ENV) if reserve else {**ENV, RESERVE_ENV: "0"}
    for i in range(runs):
        room = rng.randint(150_000, size)
        target = setup["tmp"] / f"disk-{reserve}-{i}"
        with small_tmpfs(target, (room + (8 << 20)) // 1024 + 2048) as fs:
            stat = os.statvfs(fs)
            free = stat.f_bavail * stat.f_frsize
            (fs / "filler").write_bytes(b"\0" * (free - room - ((8 << 20) if reserve else 0)))
            proc = subprocess.run(
                [sys.executable, "-m", "moetrace",
                 *record_args(model, prompts, fs / "t.h5", "--max-tokens", "4", "--flush-every", str(rng.choice([1, 8, 32])))],
                capture_output=True, text=True, env=env, timeout=300,
            )  # fmt: skip
            lines = proc.stderr.strip().splitlines()
            if proc.returncode == 0:
                outcomes["fitted"] += 1
            elif proc.returncode != 1:
                outcomes[f"exit {proc.returncode}"] += 1
            elif len(lines) != 1 or not lines[0].startswith("error: disk full"):
                outcomes["not a one-line disk-full error"] += 1
            local = setup["tmp"] / f"disk-{reserve}-{i}.h5"
            local.write_bytes((fs / "t.h5").read_bytes())
        report = verify_trace(local)
        outcomes[f"file {report.status}"] += 1
        kept_total += report.num_requests
        code, _, err = run_cli(*record_args(model, prompts, local, "--max-tokens", "4", "--resume"))
        if code != 0:
            outcomes[f"resume failed: {err.strip()[:80]}"] += 1
            continue
        same, lost = compare(local, reference)
        recovered += same
        lost_total += lost
    n = len(reference)
    how = "moetrace's reserve check" if reserve else "HDF5 itself (reserve 0)"
    ROWS.append(
        (
            f"disk full (tmpfs, 150 kB to one trace of room), caught by {how}",
            f"{runs} runs",
            _fmt(outcomes) + f"; {kept_total} requests kept",
            f"{recovered} / {runs * n} after `--resume`",
            lost_total,
        )
    )


def tamper_runs(flips: int, setup: dict, rng: random.Random) -> None:
    """Flip one random byte of a complete trace; verify must notice any change to what reads back."""
    source = setup["reference_path"]
    data = source.read_bytes()
    original = _content(source)
    outcomes: Counter = Counter()
    for i in range(flips):
        path = setup["tmp"] / f"tamper-{i}.h5"
        buf = bytearray(data)
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
        try:
            status = verify_guarded(path, stall_s=10).status
        except MoetraceError:  # not a trace any more (signature or format attribute hit)
            status = "refused"
        changed = _guarded_content(path) != original
        if status == "ok" and changed:
            outcomes["MISSED: content changed, verify ok"] += 1
        elif status == "ok":
            outcomes["harmless (unused bytes; content reads back identical)"] += 1
        else:
            outcomes["detected" if changed else "detected (flagged, content identical)"] += 1
        path.unlink()
    missed = outcomes["MISSED: content changed, verify ok"]
    ROWS.append(
        (
            "one flipped bit anywhere in a complete trace",
            f"{flips} files",
            _fmt(outcomes),
            "-",
            f"{missed} missed",
        )
    )


def _guarded_content(path: Path):
    """``_content`` in a child: a corrupted file can hang or crash HDF5."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=lambda: send.send(_content(path)), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(10):
            with contextlib.suppress(EOFError):
                return receive.recv()
        return "unreadable: HDF5 stuck or crashed"
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)


def _content(path: Path):
    """Everything a reader gets from the file, or a marker when it does not read."""
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in f.attrs.items()}
            return (
                json.dumps(attrs, sort_keys=True, default=str),
                f["routed_experts"][:].tobytes(),
                f["token_ids"][:].tobytes(),
                f["requests"][:].tolist(),  # tolist: vlen strings by value, not by pointer
                str(f["requests"].dtype),
            )
    except Exception as exc:
        return f"unreadable: {type(exc).__name__}"


def truncation_runs(cuts: int, setup: dict, rng: random.Random) -> None:
    data = setup["reference_path"].read_bytes()
    outcomes: Counter = Counter()
    for i in range(cuts):
        path = setup["tmp"] / f"cut-{i}.h5"
        path.write_bytes(data[: rng.randrange(len(data))])
        proc = subprocess.run(
            [sys.executable, "-m", "moetrace", "verify", str(path)],
            capture_output=True, text=True, env=ENV, timeout=60,
        )  # fmt: skip
        if "Traceback" in proc.stderr:
            outcomes["TRACEBACK"] += 1
        elif proc.returncode == 0:
            outcomes["MISSED (exit 0)"] += 1
        else:
            outcomes[f"exit {proc.returncode}"] += 1
        path.unlink()
    ROWS.append(("file truncated at a random byte", f"{cuts} files", _fmt(outcomes), "-", "-"))


def reader_runs(copies: int, tmp: Path, rng: random.Random) -> None:
    """Corrupted copies of a real demo trace: verify, export and inspect must agree on each."""
    from support.corruption import corrupted_copies, read_all_ways

    prompts = write_jsonl(
        tmp / "demo-p.jsonl",
        [{"id": f"d{i}", "prompt": f"Tell me about expert number {i}."} for i in range(12)],
    )
    source = tmp / "demo.h5"
    code, _, err = run_cli(
        "record", "demo", str(prompts), "-o", str(source), "-q", "--max-tokens", "6"
    )
    assert code == 0, err
    verdicts: Counter = Counter()
    outcomes: Counter = Counter()
    for i, (what, data) in enumerate(corrupted_copies(source, copies, rng)):
        path = tmp / f"read-{i}.h5"
        path.write_bytes(data)
        readings = read_all_ways(path)
        verdicts[f"verify {readings.verify}"] += 1
        problems = readings.disagreements()
        for problem in problems:
            outcomes[problem.split(":")[0] + ": " + problem.split(": ", 1)[1][:60]] += 1
            print(f"reader case {i} ({what}): {problem}", file=sys.stderr)
        if not problems:
            outcomes["export and inspect agree with verify, one line, no traceback"] += 1
        path.unlink()
        path.with_suffix(".jsonl").unlink(missing_ok=True)
    ROWS.append(
        (
            "corrupted copies of a demo-model trace (one flipped bit aimed at rows, tokens, "
            "records, tokenizer files or HDF5 structure; anywhere; truncation), read by "
            "`verify`, `export` and `inspect --all`",
            f"{copies} files",
            _fmt(verdicts) + "; " + _fmt(outcomes),
            "-",
            "-",
        )
    )


def fuzz_runs(parser_examples: int, intake_examples: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from moetrace.errors import InputError
    from moetrace.inputs.prompts import iter_prompts
    from support.prompt_lines import _valid_or_input_error, keyed, lines, near_valid

    count = Counter()
    common = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))

    @settings(max_examples=parser_examples, **common)
    @given(keyed | near_valid())
    def parse(obj):
        count["lines"] += 1
        _valid_or_input_error(json.dumps(obj))

    @settings(max_examples=parser_examples // 4, **common)
    @given(st.lists(lines, max_size=6), st.booleans())
    def files(items, skip):
        count["files"] += 1
        raw = b"\n".join(
            x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in items
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "f.jsonl"
            path.write_bytes(raw)
            with contextlib.suppress(InputError):
                list(iter_prompts(path, skip_invalid=skip))

    parse()
    files()
    env = {**ENV, "MOETRACE_FUZZ_EXAMPLES": str(intake_examples)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "reliability" / "test_reliability_fuzz.py")],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    intake = "no crash" if proc.returncode == 0 else "FAILED:\n" + proc.stdout[-2000:]
    ROWS.append(
        (
            "fuzzed JSONL (hypothesis): parser lines, whole files, and files through `Recording` "
            "(demo tokenizer, context and KV checks)",
            f"{count['lines']} lines, {count['files']} files, {intake_examples} intake files",
            "no crash: every input parsed or got a one-line InputError"
            if proc.returncode == 0
            else intake,
            "-",
            "-",
        )
    )


def scheduler_runs(examples: int) -> None:
    env = {**ENV, "MOETRACE_PROPERTY_EXAMPLES": str(examples)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "engine" / "test_scheduler_properties.py")],
        capture_output=True, text=True, env=env, timeout=7200,
    )  # fmt: skip
    ok = proc.returncode == 0
    ROWS.append(
        (
            "scheduler / block manager properties (random arrivals, lengths, shared prefixes, "
            "aborts, KV pressure, budgets, sync + async scheduling)",
            f"{examples} + {examples} workloads on the causal fake, {max(12, examples // 20)} on the real tiny model",
            "all invariants held" if ok else "FAILED:\n" + proc.stdout[-3000:],
            "-",
            0 if ok else "see failure",
        )
    )


def _fmt(outcomes: Counter) -> str:
    return ", ".join(f"{n} {what}" for what, n in outcomes.most_common())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", default="", help="comma list: signals,disk,tamper,cut,reads,fuzz,sched"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    q = args.quick
    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tiny_checkpoint(tmp / "tiny")
        prompts = write_jsonl(tmp / "p.jsonl", token_prompts(400, seed=11, max_len=24))
        reference_path = tmp / "reference.h5"
        code, _, err = run_cli(*record_args(model, prompts, reference_path, "--max-tokens", "4"))
        assert code == 0, err
        setup = dict(
            tmp=tmp,
            model=model,
            prompts=prompts,
            reference_path=reference_path,
            reference=requests_by_id(reference_path),
        )
        started = time.monotonic()
        if not only or "signals" in only:
            signal_runs("SIGINT (Ctrl-C)", signal.SIGINT, 3 if q else 12, setup, rng)
            signal_runs("SIGTERM", signal.SIGTERM, 3 if q else 12, setup, rng)
            signal_runs("kill -9", signal.SIGKILL, 4 if q else 25, setup, rng)
        if (not only or "disk" in only) and os.geteuid() == 0:
            disk_full_runs(2 if q else 8, True, setup, rng)
            disk_full_runs(2 if q else 8, False, setup, rng)
        if not only or "tamper" in only:
            tamper_runs(40 if q else 300, setup, rng)
        if not only or "cut" in only:
            truncation_runs(8 if q else 40, setup, rng)
        if not only or "reads" in only:
            reader_runs(54 if q else 540, tmp, rng)
        if not only or "fuzz" in only:
            fuzz_runs(500 if q else 20000, 30 if q else 600)
        if not only or "sched" in only:
            scheduler_runs(300 if q else 4000)
        elapsed = time.monotonic() - started
    print("| fault | tried | what happened | requests recovered | rows lost |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print(f"\n(campaign took {elapsed:.0f} s, seed {args.seed})")


if __name__ == "__main__":
    main()
