"""How many threads torch uses on the CPU for a given model.

Intra-op threads pay off only when each matmul is large.  For the small
models a CPU run is for (the demo, test checkpoints) the hand-off between
threads costs more than the work, and on a busy two-core machine it was
measured 100x slower with two threads than with one (the demo: 30 s vs
0.3 s for 24 requests).  Large models keep every core.
"""

from __future__ import annotations

import torch

SMALL_MODEL_PARAMS = 100_000_000


def configure_cpu_threads(model: torch.nn.Module, device: torch.device) -> int:
    """Set torch's intra-op thread count for ``model`` on the CPU; returns it."""
    if device.type != "cpu":
        return torch.get_num_threads()
    params = sum(p.numel() for p in model.parameters())
    if params < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
    return torch.get_num_threads()
