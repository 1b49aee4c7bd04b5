"""Where each checkpoint tensor goes in our modules.

Our modules fuse what checkpoints keep apart (q/k/v into one projection,
gate/up into one, experts stacked into one tensor), so each checkpoint name
maps to a parameter, optionally an expert index, and optionally a row range.
Shapes are checked on every copy: a mis-shaped tensor is refused by name.
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

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        dest = self.destination(name)
        if dest is None:
            return False
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelError(
                f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        return True
