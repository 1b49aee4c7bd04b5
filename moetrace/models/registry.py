"""Which Hugging Face architectures moetrace can run, and how to build them."""

from __future__ import annotations

from collections.abc import Callable

from moetrace.errors import ModelError
from moetrace.models.base import MoEForCausalLM
from moetrace.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, Callable[[dict], MoEForCausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def resolve_architecture(config: dict, source: str) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    shown = ", ".join(names) if names else "none"
    raise ModelError(
        f"{source}: unsupported architecture ({shown}); moetrace supports "
        + ", ".join(supported_architectures())
    )


def build_model(config: dict, source: str) -> MoEForCausalLM:
    return ARCHITECTURES[resolve_architecture(config, source)](config)
