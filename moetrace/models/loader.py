"""A resolved model (models/source.py) built and filled with its weights on one device.

The checkpoint is ``config.json`` plus one or many ``*.safetensors`` (with an
index when sharded).  The model is built directly on the target device in
the target dtype, so a large checkpoint is never materialised twice.

The loader knows one device.  Tensor parallelism passes its own ``build``
(distributed/sharding.py: built on meta, cut to this rank's slices); the
loader then reads only those slices, through the model's ``WeightMap``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moetrace.errors import ModelError
from moetrace.layers.mxfp4 import random_mxfp4_
from moetrace.models.base import MoEForCausalLM
from moetrace.models.checkpoint_files import open_safetensors, safetensors_files
from moetrace.models.registry import build_model
from moetrace.models.source import ModelSource, resolve_model
from moetrace.models.weights import WeightMap

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")

# (config, source for messages, dtype, device) -> the family's model, parameters allocated.
Builder = Callable[[dict, str, torch.dtype, torch.device], MoEForCausalLM]


@dataclass
class LoadedModel:
    model: MoEForCausalLM
    source: ModelSource
    dtype: torch.dtype

    @property
    def config(self) -> dict:
        return self.source.config

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def config_digest(self) -> str:
        return self.source.config_digest


def resolve_dtype(name: str, config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ModelError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls on CPU are slow and rarely what a CPU run wants
    declared = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return DTYPES.get(declared.replace("torch.", ""), torch.bfloat16)


def instantiate(
    config: dict, source: str, dtype: torch.dtype, device: torch.device
) -> MoEForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, source)
    finally:
        torch.set_default_dtype(previous)
    model.hf_config = config  # what a few-layer copy for kernel warm-up is built from
    return model.eval()


def load_safetensors(
    model: MoEForCausalLM, path: Path, device: torch.device, *, headers_only: bool = False
) -> None:
    """Copy every tensor the model needs into it.

    ``headers_only`` (for a model on the ``meta`` device) reads only the files'
    headers and hands the model empty tensors of the stored shape and dtype, so
    each family's own shape checks run before anything is allocated.
    """
    expected = model.expected_weight_names()
    seen: set[str] = set()
    for file in safetensors_files(path):
        with open_safetensors(file, "cpu" if headers_only else str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in expected:
                    continue
                try:
                    if headers_only:
                        _check_header(model, name, f.get_slice(name))
                    else:
                        model.load_weight(name, _read_tensor(f, name, model))
                except ModelError as exc:
                    raise ModelError(f"{file}: {exc}") from None
                seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(f"{path}: checkpoint lacks {', '.join(missing[:3])}{more}")


_HEADER_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _check_header(model: MoEForCausalLM, name: str, piece) -> None:
    """Load a ``meta`` tensor of the stored shape: a shape the model cannot take raises here."""
    dtype = _HEADER_DTYPES.get(piece.get_dtype())
    if dtype is None:
        return  # a dtype torch has no name for here; the real load decides
    tensor = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
    try:
        model.load_weight(name, tensor)
    except ModelError:
        raise
    except Exception:  # a conversion that needs real values; the real load checks it
        pass


def _read_tensor(f, name: str, model: MoEForCausalLM) -> torch.Tensor:
    """The checkpoint tensor, or under tensor parallelism only this rank's slice of it."""
    weights = getattr(model, "weights", None)
    narrow = weights.source_narrow(name) if isinstance(weights, WeightMap) else None
    if narrow is None:
        return f.get_tensor(name)
    dim, start, size, full = narrow
    piece = f.get_slice(name)
    shape = piece.get_shape()
    if len(shape) <= dim or shape[dim] != full:
        raise ModelError(
            f"tensor {name!r} has shape {list(shape)}, expected {full} along dim {dim}"
        )
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + size)
    return piece[tuple(index)]


def fill_dummy(model: MoEForCausalLM, seed: int, std: float = 0.02) -> None:
    """Seeded random weights: matrices N(0, std), norm scales 1, biases 0.

    MXFP4 experts get random codes under a scale that puts their RMS near ``std``.

    A tensor-parallel rank draws each split matrix whole and keeps its slice,
    so its weights are exactly the single-device run's.
    """
    shards = getattr(model, "param_shards", None) or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            device = param.device
            gen = torch.Generator(device=device).manual_seed(seed + _stable_index(name))
            if not param.is_floating_point():  # MXFP4 experts: random codes, scales to match std
                random_mxfp4_(param, name, std, gen)
            elif param.dim() == 1:
                if "norm" in name and not name.endswith(".bias"):  # LayerNorm bias: 0
                    param.fill_(1.0)
                else:
                    param.zero_()
            elif name in shards:  # this rank's slice: draw the whole tensor, keep the slice
                full = torch.empty(shards[name].full_shape, dtype=param.dtype, device=device)
                full.normal_(0.0, std, generator=gen)
                shards[name].copy_from_full(param, full)
            else:
                param.normal_(0.0, std, generator=gen)


def _stable_index(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def load_model(
    source: ModelSource | str,
    *,
    device: torch.device,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    build: Builder | None = None,
) -> LoadedModel:
    """Load a resolved model (or resolve MODEL first: a checkpoint directory, a cached model
    id or ``demo``); ``build`` defaults to ``instantiate``."""
    if load_format not in LOAD_FORMATS:
        raise ModelError(f"unknown load format {load_format!r}; choose {', '.join(LOAD_FORMATS)}")
    if isinstance(source, str):
        source = resolve_model(source)
    torch_dtype = resolve_dtype(dtype, source.config, device)
    model = (build or instantiate)(source.config, str(source.path), torch_dtype, device)
    if load_format == "dummy":
        fill_dummy(model, seed)
    else:
        load_safetensors(model, source.path, device)
    return LoadedModel(model, source, torch_dtype)
