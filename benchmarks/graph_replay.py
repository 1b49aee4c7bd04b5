"""A callable captured in a CUDA graph, for the benchmarks that time replays.

Kernel times in a decode step are graph replays (the engine replays its
steps), so the benchmarks time a replay too, not an eager launch sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graphed(fn: Callable[[], object], *, warmups: int = 1) -> Callable[[], None]:
    """``fn`` run ``warmups`` times on a side stream (Triton compiles, the allocator
    settles), then captured in a CUDA graph: its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def chained_us(calls: list[Callable[[], object]], *, replays: int = 5, rounds: int = 3) -> float:
    """Per-call GPU time in steady state: ``calls`` captured back to back in one graph and
    replayed, the median of ``rounds`` timings divided by ``replays * len(calls)``.

    A single replay timed by ``triton.testing.do_bench`` also pays the graph's launch
    and the write-back of the dirty lines its L2 flush leaves (several µs on the
    H200); inside a decode step a kernel pays neither.  Rotate the inputs among
    ``calls`` (more bytes than the L2 holds) so that no call reads another's data
    from the cache."""
    return replayed_us(graphed(lambda: [call() for call in calls]), len(calls), replays, rounds)


def replayed_us(replay: Callable[[], None], calls: int, replays: int = 5, rounds: int = 3) -> float:
    """µs a call of a graph ``replay`` holding ``calls`` calls: three warm replays, then the
    median of ``rounds`` timings of ``replays`` replays back to back."""
    for _ in range(3):
        replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    return sorted(times)[len(times) // 2]
