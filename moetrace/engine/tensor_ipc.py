"""Tensors a colocated trainer hands over by reference (SGLang's ``update_weights_from_tensor``).

The trainer pickles its named tensors with torch's ``ForkingPickler``, as
SGLang's ``MultiprocessingSerializer`` does, and sends the bytes base64-coded
in JSON: a CUDA tensor travels as a CUDA IPC handle to memory the trainer
keeps alive, a CPU tensor as the name of a shared-memory file (torch's
``file_system`` sharing strategy; the ``file_descriptor`` one hands file
descriptors only to the trainer's own children).  ``load_format``
``flattened_bucket`` is SGLang's ``FlattenedTensorBucket``: one uint8 tensor
and the name, shape, dtype and byte range of each tensor in it.

A pickle from the network may name any function to call, so the unpickler
here resolves only what those payloads hold -- torch's tensor and storage
rebuilders, ``torch.Size``, dtypes and the bucket's metadata record -- and
refuses anything else by name.
"""

from __future__ import annotations

import binascii
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetrace.errors import MoetraceError

_REDUCTIONS = "torch.multiprocessing.reductions"
_REBUILDERS = frozenset(
    {
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
    }
)
# Where SGLang and the trainers that copy it define the bucket's metadata record.
_METADATA_MODULES = frozenset(
    {"sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner"}
)


class TensorPayloadError(MoetraceError):
    """Serialized tensors that cannot be read; names what is wrong."""


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket: ``flat[start_idx:end_idx]`` (bytes of a uint8 bucket)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == _REDUCTIONS and name in _REBUILDERS:
            return super().find_class(module, name)
        if module == "torch" and (name in ("Tensor", "Size") or _is_dtype(name)):
            return super().find_class(module, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return super().find_class(module, name)
        if module in _METADATA_MODULES and name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        if module == "multiprocessing.resource_sharer" or name == "rebuild_storage_fd":
            raise TensorPayloadError(
                "CPU tensors shared by file descriptor reach only the sender's children: share "
                "them with torch.multiprocessing.set_sharing_strategy('file_system')"
            )
        raise TensorPayloadError(f"serialized tensors may not name {module}.{name}")


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def named_tensors(
    payloads: Sequence[bytes | str], load_format: str | None = None, rank: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of tensor-parallel ``rank``'s payload (SGLang's rule: one
    payload per rank, each on that rank's device)."""
    if not payloads:
        raise TensorPayloadError("serialized_named_tensors is empty")
    if rank >= len(payloads):
        raise TensorPayloadError(
            f"serialized_named_tensors has {len(payloads)} entries: a server of tensor-parallel "
            f"size {rank + 1} or more takes one per rank (rank {rank} has none)"
        )
    raw = payloads[rank]
    try:
        data = binascii.a2b_base64(raw) if isinstance(raw, str) else bytes(raw)
        obj = _TensorUnpickler(io.BytesIO(data)).load()
    except TensorPayloadError:
        raise
    except Exception as exc:  # a malformed pickle raises many kinds
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise TensorPayloadError(f"serialized_named_tensors: cannot read it ({text})") from None
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    if load_format not in (None, "direct"):
        raise TensorPayloadError(
            f"load_format {load_format!r}: choose direct (default) or flattened_bucket"
        )
    return _pairs(obj)


def _pairs(obj: object) -> list[tuple[str, torch.Tensor]]:
    items = list(obj.items()) if isinstance(obj, dict) else obj
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(i, (list, tuple))
        and len(i) == 2
        and isinstance(i[0], str)
        and isinstance(i[1], torch.Tensor)
        for i in items
    ):
        raise TensorPayloadError("serialized_named_tensors must hold (name, tensor) pairs")
    return [(name, tensor) for name, tensor in items]


def _unflatten(obj: object) -> list[tuple[str, torch.Tensor]]:
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or not isinstance(metadata, list):
        raise TensorPayloadError(
            "a flattened_bucket payload is a dict of flattened_tensor and metadata"
        )
    flat = flat.reshape(-1)  # uint8 with byte ranges; one dtype with element ranges before
    out = []
    for item in metadata:
        if not isinstance(item, FlattenedTensorMetadata):
            raise TensorPayloadError("flattened_bucket metadata must be FlattenedTensorMetadata")
        piece = flat[item.start_idx : item.end_idx]
        out.append((item.name, piece.view(item.dtype).reshape(item.shape)))
    return out
