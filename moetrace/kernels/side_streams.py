"""Independent kernel chains side by side, on CUDA streams forked from the current one.

A decode step's experts are two GEMMs in a row, and each pays for filling
the GPU as it starts and for its last programs draining alone as it ends.
Split into independent parts (row blocks ``part, part + parts, ...``), one
part's kernels fill the gaps another's leave.  The parts run on side streams
that wait for the current stream first and that it waits for after, so the
caller, eager or inside a CUDA-graph capture (where the fork becomes graph
branches), sees one ordered call.  Off CUDA (the Triton interpreter) the
parts run one after another.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

# How many parts a decode step's experts run in (1: one stream).
EXPERT_STREAMS = 2

_SIDE: dict[torch.device, list[torch.cuda.Stream]] = {}


def side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """``count`` streams kept per device for the side parts, made at their first use."""
    streams = _SIDE.setdefault(device, [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device))
    return streams[:count]


def run_in_parts(launch: Callable[[int, int], None], parts: int, device: torch.device) -> None:
    """``launch(part, parts)`` for every part: part 0 on the current stream, the others
    beside it on side streams, all joined before this returns (in stream order)."""
    run_beside([partial(launch, part, parts) for part in range(parts)], device)


def run_beside(launches: list[Callable[[], None]], device: torch.device) -> None:
    """Each of ``launches``: the first on the current stream, the others beside it on side
    streams, all joined before this returns (in stream order)."""
    if len(launches) == 1 or device.type != "cuda":
        for launch in launches:
            launch()
        return
    main = torch.cuda.current_stream(device)
    sides = side_streams(device, len(launches) - 1)
    for stream in sides:
        stream.wait_stream(main)
    launches[0]()
    for launch, stream in zip(launches[1:], sides, strict=True):
        with torch.cuda.stream(stream):
            launch()
    for stream in sides:
        main.wait_stream(stream)
