"""Routing replay (R3) on the trainer's side, for Hugging Face transformers MoE models.

``replay_routing`` makes a model route by given expert ids (the rollout
engine's), ``record_routing`` records what it routes by itself,
``write_trace`` turns that into a trace for ``moetrace diff``,
``batch_routing`` lays per-sequence rows on a batch for trainers that split
batches by rows, and ``router_replay_indices`` feeds the same rows to
Megatron-LM's ``RouterReplay``.  See docs/r3.md.
"""

from __future__ import annotations

from moetrace.r3.layouts import LAYOUTS, batch_routing
from moetrace.r3.megatron import router_replay_indices
from moetrace.r3.model_routers import TESTED_TRANSFORMERS
from moetrace.r3.record import RoutingRecord, record_routing
from moetrace.r3.replay import replay_routing
from moetrace.r3.trace_out import RoutedSequence, write_trace

__all__ = [
    "LAYOUTS",
    "TESTED_TRANSFORMERS",
    "RoutedSequence",
    "RoutingRecord",
    "batch_routing",
    "record_routing",
    "replay_routing",
    "router_replay_indices",
    "write_trace",
]
