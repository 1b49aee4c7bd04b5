"""Where each checkpoint tensor goes in our modules.

Our modules fuse what checkpoints keep apart (q/k/v into one projection,
gate/up into one, experts stacked into one tensor), so each checkpoint name
maps to a parameter, optionally an expert index, and optionally a row range.
Shapes are checked on every copy: a mis-shaped tensor is refused by name.
Under tensor parallelism a target also says which slice of the checkpoint
tensor this rank keeps (``narrow``), so a rank reads only its own slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrace.errors import ModelError


@dataclass(frozen=True)
class Target:
    param: str
    index: int | None = None
    row_start: int | None = None
    row_count: int | None = None
    # (dim, start, size, full size along dim): the slice of the checkpoint tensor to keep
    narrow: tuple[int, int, int, int] | None = None


def check_kind(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a tensor whose values the copy would change in kind: integers into a
    floating-point parameter or back, or one integer type into another."""
    if tensor.is_floating_point() and dtype.is_floating_point:
        return
    if tensor.dtype != dtype:
        expected = "a floating-point dtype" if dtype.is_floating_point else str(dtype)
        raise ModelError(f"tensor {name!r} has dtype {tensor.dtype}, expected {expected}")


class WeightMap:
    def __init__(self, module: nn.Module) -> None:
        self._params = dict(module.named_parameters(remove_duplicate=False))
        self.targets: dict[str, Target] = {}

    def direct(self, name: str, param: str, *, index: int | None = None) -> None:
        self._add(name, Target(param, index))

    def rows(
        self, name: str, param: str, start: int, count: int, *, index: int | None = None
    ) -> None:
        self._add(name, Target(param, index, start, count))

    def _add(self, name: str, target: Target) -> None:
        if target.param not in self._params:
            raise KeyError(f"weight map names unknown parameter {target.param!r}")
        self.targets[name] = target

    def destination(self, name: str) -> torch.Tensor | None:
        target = self.targets.get(name)
        if target is None:
            return None
        dest = self._params[target.param].data
        if target.index is not None:
            dest = dest[target.index]
        if target.row_start is not None:
            dest = dest[target.row_start : target.row_start + target.row_count]
        return dest

    def source_narrow(self, name: str) -> tuple[int, int, int, int] | None:
        """The slice of checkpoint tensor ``name`` this model keeps; None for all of it."""
        target = self.targets.get(name)
        return None if target is None else target.narrow

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        dest = self.destination(name)
        if dest is None:
            return False
        narrow = self.targets[name].narrow
        if narrow is not None and tensor.dim() > narrow[0]:
            dim, start, size, full = narrow
            if tensor.shape[dim] == full:  # the whole tensor, not a slice read by the loader
                tensor = tensor.narrow(dim, start, size)
            elif tensor.shape[dim] != size:
                raise ModelError(
                    f"tensor {name!r} has {tensor.shape[dim]} entries along dim {dim}, "
                    f"expected {full}"
                )
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelError(
                f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(dest.shape)}"
            )
        check_kind(name, tensor, dest.dtype)
        with torch.no_grad():
            dest.copy_(tensor)
        return True
