"""Corrupted copies of a real trace, and what every reader says about each.

Shared by tests/reliability/test_reliability_reads.py (a fixed-seed set) and
tests/support/fault_campaign.py (many more).  Random flips over the whole file mostly
land in chunk slack that no reader looks at, so flips are aimed at the bytes
that hold something: the used part of each dataset's storage (rows, tokens,
request records, tokenizer files) and the HDF5 structure around them (object
headers, attributes, B-trees, heaps: every byte that is not chunk data).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from moetrace.errors import MoetraceError
from moetrace.trace.verify import verify_guarded

READ_TIMEOUT_S = 30.0  # a reader that takes longer on a 200 kB file is stuck


def byte_regions(path: Path) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges ``[start, end)`` of the file, by what they hold.

    Each dataset's used bytes (chunks are filled from the front; compressed
    chunks count whole) under its name, and ``structure``: every byte outside
    chunk storage.
    """
    regions: dict[str, list[tuple[int, int]]] = {}
    storage: list[tuple[int, int]] = []

    def visit(name: str, obj) -> None:
        if not isinstance(obj, h5py.Dataset) or obj.shape is None:
            return
        item = obj.dtype.itemsize * int(np.prod(obj.shape[1:], dtype=np.int64))
        if obj.chunks is None:
            offset = obj.id.get_offset()
            if offset is not None:
                size = obj.id.get_storage_size()
                storage.append((offset, offset + size))
                regions[name] = [(offset, offset + item * obj.shape[0])]
            return
        per = obj.chunks[0]
        used = []
        for i in range(obj.id.get_num_chunks()):
            info = obj.id.get_chunk_info(i)
            start = info.byte_offset
            storage.append((start, start + info.size))
            if obj.compression:
                used.append((start, start + info.size))
            else:
                rows = min(per, obj.shape[0] - info.chunk_offset[0])
                used.append((start, start + rows * item))
        regions[name] = used

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    size = path.stat().st_size
    structure, at = [], 0
    for start, end in sorted(storage):
        if start > at:
            structure.append((at, start))
        at = max(at, end)
    if at < size:
        structure.append((at, size))
    regions["structure"] = structure
    return regions


def _pick(ranges: list[tuple[int, int]], rng: random.Random) -> int:
    total = sum(end - start for start, end in ranges)
    k = rng.randrange(total)
    for start, end in ranges:
        if k < end - start:
            return start + k
        k -= end - start
    raise AssertionError("unreachable")


def corrupted_copies(source: Path, count: int, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """``count`` damaged variants of ``source``: (what was done, the file's bytes).

    Round-robin over the regions (one flipped bit, aimed), plus a flip anywhere
    and a truncation at a random byte.
    """
    data = source.read_bytes()
    regions = byte_regions(source)
    kinds = [*sorted(regions), "anywhere", "truncated"]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        if kind == "truncated":
            cut = rng.randrange(len(data))
            yield f"truncated at byte {cut}", data[:cut]
            continue
        at = rng.randrange(len(data)) if kind == "anywhere" else _pick(regions[kind], rng)
        bit = rng.randrange(8)
        buf = bytearray(data)
        buf[at] ^= 1 << bit
        yield f"bit {bit} of byte {at} flipped ({kind})", bytes(buf)


@dataclass
class Readings:
    """What ``verify``, ``export`` and ``inspect`` made of one file."""

    verify: str  # ok, incomplete, damaged, or refused (not a trace at all)
    export: tuple[int | str, str]  # (exit code, or "hang"/"crash N"; standard error)
    inspect: tuple[int | str, str]

    def disagreements(self) -> list[str]:
        """How the readers fail the rule: damaged (or refused) <=> non-zero exit, one line."""
        bad = self.verify in ("damaged", "refused")
        found = []
        for name, (code, err) in (("export", self.export), ("inspect", self.inspect)):
            text = err.strip()
            if isinstance(code, str):
                found.append(f"{name}: {code}")
            elif "Traceback" in text:
                found.append(f"{name}: traceback: {text.splitlines()[-1]}")
            elif bad and code == 0:
                found.append(f"{name}: exit 0 on a file verify calls {self.verify}")
            elif not bad and code != 0:
                found.append(f"{name}: exit {code} on a file verify calls {self.verify}: {text}")
            elif code != 0 and len(text.splitlines()) != 1:
                found.append(f"{name}: {len(text.splitlines())} lines: {text[:300]}")
        return found


def read_all_ways(path: Path) -> Readings:
    try:
        status = verify_guarded(path, stall_s=READ_TIMEOUT_S).status
    except MoetraceError:
        status = "refused"
    return Readings(
        status,
        guarded_cli("export", str(path), "-o", str(path.with_suffix(".jsonl")), "--overwrite"),
        guarded_cli("inspect", str(path), "--all"),
    )


def guarded_cli(*args: str) -> tuple[int | str, str]:
    """``moetrace ARGS`` in a forked child: a file that hangs or crashes HDF5 is reported."""
    import moetrace.cli.app  # noqa: F401  (imported once here, not in every child)
    from support.reliability import run_cli

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            code, _, err = run_cli(*args)
        except BaseException as exc:  # escaped main(): the console script prints a traceback
            code, err = 1, f"Traceback (escaped main): {type(exc).__name__}: {exc}"
        send.send((code, err))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        if receive.poll(READ_TIMEOUT_S):
            with contextlib.suppress(EOFError):
                return receive.recv()
            proc.join(5)
            return f"crash {proc.exitcode}", ""
        return "hang", ""
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        receive.close()
