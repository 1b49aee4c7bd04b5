"""New weights for a served model, checked whole before any is copied, then copied in place.

An RL trainer pushes its policy into the rollout server between steps, as
checkpoint-named tensors (a checkpoint directory, a broadcast, tensors handed
over by IPC).  Every name, shape and dtype is first tried on a twin of the
model built on the ``meta`` device: the family's own loading code runs there
without memory, so a tensor the model cannot take is refused (with its name)
before the served model is touched, and a refused update leaves it whole.

Then each tensor is copied into the storage of the parameter it belongs to
(``model.load_weight``): the CUDA graphs captured at start-up and the
pointers the kernels hold stay valid, so nothing is re-captured.  The one
exception is an MXFP4 scale past the fast decoder's range, which changes the
kernel a graph baked in: ``load`` reports it and the engine re-captures.
MXFP4 experts are re-laid for the kernel by the same loading code as at
start-up, and a tensor-parallel rank keeps its own slice of each tensor
(``WeightMap`` narrows a whole tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moetrace.errors import ModelError, MoetraceError
from moetrace.models.base import MoEForCausalLM
from moetrace.models.loader import instantiate, load_safetensors
from moetrace.models.source import ModelSource, resolve_model

# Module attributes that differ between a served model and a fresh build of the same one.
_RUNTIME_ATTRIBUTES = frozenset({"training", "use_triton", "mxfp4_wide_scales"})


class WeightUpdateError(MoetraceError):
    """An update the served model cannot take; nothing of it was applied."""


@dataclass(frozen=True)
class TensorSpec:
    """What a trainer says it sends: a checkpoint name, a dtype and a shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def parse_dtype(name: str) -> torch.dtype:
    """A dtype as trainers name it (``bfloat16``, ``torch.bfloat16``)."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r} (expected a torch dtype such as bfloat16)")
    return value


class WeightUpdater:
    """Checks updates against a ``meta`` twin of ``model`` and copies them into ``model``."""

    def __init__(self, model: MoEForCausalLM) -> None:
        if model.hf_config is None:
            raise MoetraceError("the model was not built from a config.json: no weight updates")
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self._twin: MoEForCausalLM | None = None
        self._expected: set[str] | None = None

    @property
    def twin(self) -> MoEForCausalLM:
        """The model again on ``meta``: shapes and loading rules, no memory."""
        if self._twin is None:
            config = self.model.hf_config or {}
            self._twin = instantiate(config, "weight update", self.dtype, torch.device("meta"))
        return self._twin

    @property
    def expected(self) -> set[str]:
        """Every tensor name of the whole model: under expert parallelism a rank takes the
        names of experts it does not hold too, and skips them when copying."""
        if self._expected is None:
            self._expected = self.twin.expected_weight_names()
        return self._expected

    # ---------------------------------------------------------------- checks
    def check(self, specs: Sequence[TensorSpec]) -> None:
        """Refuse the whole update if any tensor is unknown or has a shape or dtype the
        model cannot take; the message names the first few."""
        problems: list[str] = []
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                problems.append(f"{spec.name!r} is given twice")
            elif spec.name not in self.expected:
                problems.append(f"{spec.name!r} is not a tensor of this {self.model.architecture}")
            else:
                problem = self._try_on_twin(spec)
                if problem is not None:
                    problems.append(problem)
            seen.add(spec.name)
        pending = getattr(self.twin, "_pending", None)
        if isinstance(pending, dict):
            pending.clear()  # MXFP4 halves the twin held waiting for their partner
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise WeightUpdateError(
                f"{len(problems)} of {len(specs)} tensors refused, nothing updated: "
                + "; ".join(problems[:3])
                + more
            )

    def _try_on_twin(self, spec: TensorSpec) -> str | None:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        try:
            self.twin.load_weight(spec.name, tensor)
        except ModelError as exc:
            return str(exc)
        except Exception:  # a conversion that needs values (MXFP4 re-layout); the copy decides
            return None
        return None

    def check_checkpoint(self, source: ModelSource | Path) -> None:
        """Refuse a checkpoint (resolved, or a directory) that is not one of the served model:
        another architecture or shape, another routing rule, a tensor missing or mis-shaped."""
        if not isinstance(source, ModelSource):
            source = resolve_model(str(source))
        path = source.path
        other = instantiate(source.config, str(path), self.dtype, torch.device("meta"))
        difference = _first_difference(self.twin, other)
        if difference is not None:
            raise WeightUpdateError(
                f"{path}: its config.json builds another model than the one served ({difference})"
            )
        load_safetensors(self.twin, path, torch.device("meta"), headers_only=True)

    # ---------------------------------------------------------------- copies
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Copy checked tensors into the model (a tensor-parallel rank keeps its slice, and
        skips what it does not hold); True if a CUDA graph must be re-captured."""
        before = _wide_scales(self.model)
        with torch.no_grad():
            for name, tensor in named:
                self.model.load_weight(name, tensor)
        return _wide_scales(self.model) != before

    def load_checkpoint(self, path: Path, device: torch.device) -> bool:
        """Every tensor of a checked checkpoint directory, read straight into the model."""
        before = _wide_scales(self.model)
        load_safetensors(self.model, path, device)
        return _wide_scales(self.model) != before


def _wide_scales(model: nn.Module) -> list[bool]:
    return [bool(getattr(m, "mxfp4_wide_scales", False)) for m in model.modules()]


def _signature(module: nn.Module) -> dict:
    """A module's type, plain settings and parameter shapes: what decides its computation."""
    plain = (bool, int, float, str, type(None))
    settings = {
        key: value
        for key, value in vars(module).items()
        if not key.startswith("_")
        and key not in _RUNTIME_ATTRIBUTES
        and (isinstance(value, plain) or (isinstance(value, tuple) and all(
            isinstance(v, plain) for v in value)))
    }  # fmt: skip
    shapes = {key: (tuple(p.shape), p.dtype) for key, p in module.named_parameters(recurse=False)}
    return {"type": type(module).__name__, "settings": settings, "parameters": shapes}


def _first_difference(served: nn.Module, other: nn.Module) -> str | None:
    """Where two builds differ (module name and what), or None if they compute alike."""
    a, b = dict(served.named_modules()), dict(other.named_modules())
    for name in a.keys() | b.keys():
        if name not in a or name not in b:
            return f"module {name} exists in only one of them"
    for name, module in a.items():
        mine, theirs = _signature(module), _signature(b[name])
        if mine == theirs:
            continue
        where = name or "the model"
        for part in ("type", "settings", "parameters"):
            if mine[part] == theirs[part]:
                continue
            if part == "type":
                return f"{where}: {mine['type']} vs {theirs['type']}"
            keys = sorted(mine[part].keys() | theirs[part].keys())
            key = next(k for k in keys if mine[part].get(k) != theirs[part].get(k))
            return f"{where}.{key}: {mine[part].get(key)} vs {theirs[part].get(key)}"
    return None
