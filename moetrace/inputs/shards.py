"""Data-parallel shards: ``--num-shards K --shard-index i`` records every K-th prompt.

A shard takes the prompts whose input index (0-based position among the
lines that parse, as in the trace's ``index`` column) satisfies
``index % K == i``.  The choice depends on the input file only, so K
machines given the same file record disjoint sets whose union is the whole
file, and ``moetrace merge`` joins their traces.  Requests keep their input
index, so a prompt without its own seed samples exactly as in one run.

Reordering the file moves prompts between shards; sharding by a hash of the
request id would not, but would give uneven shards and is not needed while
every shard reads the same file (docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Iterator

from moetrace.errors import MoetraceError
from moetrace.inputs.prompts import PromptReader, PromptSpec


def check_shard_args(num_shards: int, shard_index: int) -> None:
    if num_shards < 1:
        raise MoetraceError(f"--num-shards must be at least 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise MoetraceError(
            f"--shard-index must be in 0..{num_shards - 1} for --num-shards {num_shards}, "
            f"got {shard_index}"
        )


def in_shard(index: int, num_shards: int, shard_index: int) -> bool:
    return index % num_shards == shard_index


class ShardedPrompts:
    """A prompt reader that yields only this shard's prompts (and keeps the reader's errors)."""

    def __init__(self, reader: PromptReader, num_shards: int, shard_index: int) -> None:
        check_shard_args(num_shards, shard_index)
        self.reader = reader
        self.num_shards = num_shards
        self.shard_index = shard_index

    @property
    def source(self) -> str:
        return self.reader.source

    @property
    def errors(self) -> list:
        return self.reader.errors

    def __iter__(self) -> Iterator[PromptSpec]:
        for spec in self.reader:
            if in_shard(spec.index, self.num_shards, self.shard_index):
                yield spec


def select_shard(
    reader: PromptReader, num_shards: int, shard_index: int
) -> PromptReader | ShardedPrompts:
    """The reader itself for an unsharded run, else its shard."""
    if num_shards == 1:
        return reader
    return ShardedPrompts(reader, num_shards, shard_index)


def shard_settings(num_shards: int, shard_index: int) -> dict:
    """What a trace records about its shard (``engine_settings``), for merge's checks."""
    return {"num_shards": num_shards, "shard_index": shard_index}


def check_shard_set(settings: list[dict], names: list[str]) -> list[int]:
    """The shards of a ``--num-shards`` split that a set of shard traces lacks.

    ``settings`` are the shards' ``engine_settings``; traces recorded without
    ``--num-shards`` carry no shard keys and are not checked.  Refuses two
    traces of the same shard, or of different splits.
    """
    sharded = [
        (s.get("num_shards"), s.get("shard_index"), n) for s, n in zip(settings, names, strict=True)
    ]
    sharded = [(k, i, n) for k, i, n in sharded if k is not None and int(k) > 1]
    if not sharded:
        return []
    counts = {int(k) for k, _, _ in sharded}
    if len(counts) > 1:
        raise MoetraceError(
            "shards were recorded with different --num-shards ("
            + ", ".join(f"{n}: {k}" for k, _, n in sharded)
            + ")"
        )
    seen: dict[int, str] = {}
    for _, index, name in sharded:
        if int(index) in seen:
            raise MoetraceError(f"{seen[int(index)]} and {name} are both shard {index}")
        seen[int(index)] = name
    total = counts.pop()
    return sorted(set(range(total)) - set(seen))
