"""Before a byte of the model is allocated: build it on ``meta`` and hold it against
the checkpoint's headers and the device's memory.

``config.json`` passing its range checks (models/config_checks.py) still does
not say that the weights have the shapes it implies, or that the model and
the KV cache the options ask for fit the device: found out by allocating,
they cost a long load and end in an allocation traceback (``--num-kv-blocks
1000000000000`` asked numpy for 3.6 TiB).  A model built on the ``meta``
device takes no memory and is built in well under a second, so it answers
both first: every checkpoint tensor's stored shape goes through the family's
own loading checks, and the bytes of the weights, KV cache, routing store
and capture buffer are added up against what the device has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moetrace.capture.capturer import capture_dtype
from moetrace.engine.memory import kv_bytes_per_block
from moetrace.errors import CapacityError, ModelError
from moetrace.models.base import MoEForCausalLM
from moetrace.models.loader import instantiate, load_safetensors
from moetrace.models.source import ModelSource
from moetrace.trace.metadata import expert_id_dtype

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryAsk:
    """The engine options that decide how much memory a run allocates beside the weights."""

    num_kv_blocks: int | None
    block_size: int
    max_num_batched_tokens: int


def preflight(
    source: ModelSource,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    ask: MemoryAsk,
    whole_model_on_device: bool = True,
) -> None:
    """Refuse, in one line, a model that cannot be built, loaded or held; allocates nothing.

    ``whole_model_on_device`` is False under tensor parallelism, where each
    device holds a slice and the memory sum would overstate it.
    """
    model = build_on_meta(source, dtype)
    if load_format != "dummy":
        load_safetensors(model, source.path, torch.device("meta"), headers_only=True)
    if whole_model_on_device:
        check_memory(model, device, ask)


def build_on_meta(source: ModelSource, dtype: torch.dtype) -> MoEForCausalLM:
    try:
        return instantiate(source.config, source.name, dtype, torch.device("meta"))
    except ModelError:
        raise
    except Exception as exc:  # sizes that are each in range but do not fit together
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise ModelError(
            f"{source.path / 'config.json'}: cannot build the model it describes ({cause})"
        ) from None


def check_memory(model: MoEForCausalLM, device: torch.device, ask: MemoryAsk) -> None:
    total = device_memory(device)
    if total is None:
        return
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    where = f"{device.type} memory ({total / GIB:,.1f} GiB)"
    if weights > total:
        raise CapacityError(
            f"{model.architecture} of this config.json needs {weights / GIB:,.1f} GiB for its "
            f"weights in {_dtype_name(model)}, more than the {where}"
        )
    layers, top_k = len(model.moe_layer_indices), model.top_k
    # Per token of a step: staged inputs (3 slots of 4 int64) and the capture buffer with
    # its copy ring of 2 (the model runner's and capture's static buffers).
    per_token = 96 + 3 * layers * top_k * capture_dtype(model.num_experts).itemsize
    capture = ask.max_num_batched_tokens * per_token
    if weights + capture > total:
        raise CapacityError(
            f"--max-num-batched-tokens {ask.max_num_batched_tokens}: the per-step input and "
            f"routing buffers ({capture / GIB:,.1f} GiB) and the weights "
            f"({weights / GIB:,.1f} GiB) need more than the {where}"
        )
    if ask.num_kv_blocks is None:
        return  # sized from the memory that is left
    slots = ask.num_kv_blocks * ask.block_size
    kv = ask.num_kv_blocks * kv_bytes_per_block(model, ask.block_size)
    rows = slots * (layers * top_k * expert_id_dtype(model.num_experts).itemsize + 8)
    if weights + capture + kv + rows > total:
        raise CapacityError(
            f"--num-kv-blocks {ask.num_kv_blocks}: {ask.num_kv_blocks:,} blocks of "
            f"{ask.block_size} tokens need {kv / GIB:,.1f} GiB of KV cache and "
            f"{rows / GIB:,.1f} GiB of routing store beside {weights / GIB:,.1f} GiB of weights, "
            f"more than the {where}"
        )


def device_memory(device: torch.device) -> int | None:
    """Total memory of the device (physical memory for the CPU); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _dtype_name(model: MoEForCausalLM) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
