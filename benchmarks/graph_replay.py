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
