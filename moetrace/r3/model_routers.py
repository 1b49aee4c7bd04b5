"""A transformers MoE model's routers, found and recognised, or refused with the reason.

Routers are found by their class at the family's place in each decoder
layer (``model.layers.<i>.mlp.gate`` ...), by module name, so wrappers
(DDP, FSDP, PEFT) that keep those names are seen through.  Their output is
read by dtype and width, not position: transformers 5.x routers return the
router logits ``[N, experts]``, the weights ``[N, top_k]`` and the int ids
``[N, top_k]``, in an order that has changed between releases.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import nn

from moetrace.errors import MoetraceError
from moetrace.r3.families import FAMILIES, Family
from moetrace.r3.layouts import RoutingShape

# The transformers releases whose MoE modules these tests ran against (pyproject's test extra).
TESTED_TRANSFORMERS = "5.17 to 5.25"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def transformers_version() -> str:
    """The installed transformers' version; refuses a missing or pre-5 one."""
    try:
        import transformers
    except ImportError:
        raise MoetraceError(
            "moetrace.r3 works on Hugging Face transformers models: pip install 'moetrace[r3]'"
        ) from None
    return supported_version(transformers.__version__)


def supported_version(version: str) -> str:
    """``version``, unless its MoE modules are of the 4.x kind (routing inside each block)."""
    if int(version.split(".")[0]) < 5:
        raise MoetraceError(
            f"transformers {version}: moetrace.r3 knows the MoE modules of transformers "
            f"{TESTED_TRANSFORMERS}; 4.x routes inside each block"
        )
    return version


@dataclass
class MoELayer:
    index: int  # the decoder layer's index
    router: nn.Module
    experts: nn.Module


@dataclass
class ModelRouters:
    """A model's family and MoE layers, in decoder order."""

    family: Family
    layers: list[MoELayer]
    shape: RoutingShape
    pretrained: nn.Module  # the module holding the config (a PreTrainedModel)

    def checkpointing(self) -> bool:
        """Whether gradient (activation) checkpointing recomputes layers in backward."""
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(self.pretrained), name):
                return bool(getattr(self.pretrained, name))
        return False


def _pretrained(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if getattr(getattr(module, "config", None), "model_type", None):
            return module
    raise MoetraceError(
        f"{type(model).__name__} has no transformers config: moetrace.r3 takes a "
        "transformers ...ForCausalLM (or a wrapper around one)"
    )


def _is_a(module: nn.Module, class_name: str) -> bool:
    return any(cls.__name__ == class_name for cls in type(module).__mro__)


def find_routers(model: nn.Module) -> ModelRouters:
    """The model's routers and experts, checked against its family's known layout."""
    version = transformers_version()
    pretrained = _pretrained(model)
    config = pretrained.config
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise MoetraceError(
            f"model type {config.model_type!r} is not one moetrace.r3 knows; known: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    suffix = "." + ".".join(family.router_path)
    layers = []
    for name, module in model.named_modules():
        if not name.endswith(suffix) or not _is_a(module, family.router_class):
            continue
        found = _LAYER.search(name)
        block = model.get_submodule(name.rsplit(".", 1)[0])
        experts = getattr(block, family.experts_attr, None)
        if found is None or experts is None:
            continue
        layers.append(MoELayer(int(found.group(1)), module, experts))
    if not layers:
        raise MoetraceError(
            f"transformers {version}: no {family.router_class} at layers.<i>{suffix} in this "
            f"{config.model_type} model; moetrace.r3 knows the MoE modules of transformers "
            f"{TESTED_TRANSFORMERS}"
        )
    layers.sort(key=lambda layer: layer.index)
    first = layers[0].router
    num_experts, top_k = int(getattr(first, "num_experts", first.weight.shape[0])), int(first.top_k)
    if top_k >= num_experts:
        raise MoetraceError(f"the model routes every token to all {num_experts} experts")
    shape = RoutingShape(
        num_hidden_layers=int(config.num_hidden_layers),
        moe_layer_indices=tuple(layer.index for layer in layers),
        num_experts=num_experts,
        top_k=top_k,
    )
    return ModelRouters(family, layers, shape, pretrained)


@dataclass
class RouterOutput:
    """A router call's outputs, told apart by dtype and width, with their positions."""

    parts: tuple
    logits: int
    weights: int
    ids: int

    @classmethod
    def read(cls, router: nn.Module, output: object, shape: RoutingShape) -> RouterOutput:
        tensors = output if isinstance(output, tuple) else ()
        ints, logits, weights = [], [], []
        for i, part in enumerate(tensors):
            if not isinstance(part, torch.Tensor):
                continue
            if not part.is_floating_point():
                ints.append(i)
            elif part.shape[-1] == shape.num_experts:
                logits.append(i)
            elif part.shape[-1] == shape.top_k:
                weights.append(i)
        if len(ints) != 1 or len(logits) != 1 or len(weights) != 1:
            raise MoetraceError(
                f"transformers {transformers_version()}: {type(router).__name__} returned "
                "something other than (router logits, weights, ids); moetrace.r3 knows the "
                f"MoE modules of transformers {TESTED_TRANSFORMERS}"
            )
        return cls(tensors, logits[0], weights[0], ints[0])

    def get(self, which: str) -> torch.Tensor:
        return self.parts[getattr(self, which)]

    def replaced(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple:
        parts = list(self.parts)
        parts[self.weights], parts[self.ids] = weights, ids
        return tuple(parts)


class Watcher(Protocol):
    """What a forward tells the replay or the recording, through the hooks below."""

    def on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None: ...
    def on_forward_end(self, module: nn.Module, args: tuple, kwargs: dict, output: object): ...
    def on_router(self, moe_index: int, router: nn.Module, args: tuple, output: object): ...
    def on_experts(self, moe_index: int, experts: nn.Module, args: tuple, kwargs: dict): ...


@contextmanager
def hooked(model: nn.Module, routers: ModelRouters, watcher: Watcher) -> Iterator[None]:
    """``watcher`` hears each forward of ``model`` begin and end, each router's output (a
    router hook may return a replacement) and each experts module's arguments; the hooks
    are removed at the end, error or not."""
    handles = [
        model.register_forward_pre_hook(watcher.on_forward, with_kwargs=True),
        model.register_forward_hook(watcher.on_forward_end, with_kwargs=True, always_call=True),
    ]
    for i, layer in enumerate(routers.layers):
        handles.append(layer.router.register_forward_hook(partial(watcher.on_router, i)))
        handles.append(
            layer.experts.register_forward_pre_hook(
                partial(watcher.on_experts, i), with_kwargs=True
            )
        )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
