"""Keep a long-running process's start-up objects out of the garbage collector's scans.

Once torch, the model and the engine are built, the heap holds a few hundred
thousand objects that live until the process ends; every full (oldest-
generation) collection walks all of them: on a served burst, a pause of
over a hundred milliseconds of the event loop (docs/benchmarks.md).  A pause
like that holds up every request in flight, or, in the engine's process, a
step.

Only for processes that end with their work (the server, its engine
process): objects alive at the freeze are never collected as cycles, so a
library caller that builds and drops engines would leak them.
"""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> None:
    """Collect what start-up left behind, then exempt every surviving object from collection."""
    gc.collect()
    gc.freeze()
