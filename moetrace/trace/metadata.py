"""The facts about a recording that every trace file carries in its root attributes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

FORMAT_NAME = "moetrace-trace"
WEIGHT_DTYPES = ("float16", "float32")  # what routed_weights may be stored as
FORMAT_VERSION = 2  # the newest this code reads and writes (trace-format.md)
# Oldest on-disk structures that hold our layout: HDF5 >= 1.10 tools can read the
# file, and a killed run leaves no "file open for write" flag that needs h5clear.
LIBVER = ("earliest", "v110")


def utc_now() -> str:
    """The time as the trace's attributes write it (``created``, a resume's ``time``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def expert_id_dtype(num_experts: int) -> np.dtype:
    """Narrowest unsigned dtype that holds every expert id (no silent overflow)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


@dataclass
class TraceMetadata:
    """Model and engine facts written once per trace."""

    model: str  # the MODEL argument as given (path or built-in name)
    architecture: str  # e.g. "Qwen3MoeForCausalLM"
    config_digest: str  # sha256 of the checkpoint's config.json text (canonical JSON)
    num_hidden_layers: int
    moe_layer_indices: list[int]  # decoder layers that route, in order; routed_experts axis 1
    num_experts: int
    top_k: int
    vocab_size: int
    tokenizer: str | None = None  # path to tokenizer.json, when the model has one
    dtype: str = "float32"  # compute dtype
    engine_settings: dict = field(default_factory=dict)  # JSON-able
    moetrace_version: str = ""
    weights_dtype: str | None = None  # "float16" or "float32": routed_weights is written
    logprobs: bool = False  # the logprobs array is written
    # The tokenizer's files, stored in the trace (trace/tokenizer_files.py), by name.
    tokenizer_files: dict[str, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.weights_dtype not in (None, *WEIGHT_DTYPES):
            raise ValueError(
                f"weights_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weights_dtype!r}"
            )

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def expert_dtype(self) -> np.dtype:
        return expert_id_dtype(self.num_experts)
