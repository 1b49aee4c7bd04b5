"""Which Hugging Face architectures moetrace can run, and how to build them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moetrace.errors import ModelError

if TYPE_CHECKING:
    from moetrace.models.base import MoEForCausalLM

# Architecture name -> "module:class".  Imported on first use, so listing what
# is supported (the CLI's help) does not load torch and every family.
ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "moetrace.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "moetrace.models.deepseek:DeepseekV3ForCausalLM",
    "GptOssForCausalLM": "moetrace.models.gpt_oss:GptOssForCausalLM",
    "GraniteMoeForCausalLM": "moetrace.models.granitemoe:GraniteMoeForCausalLM",
    "MixtralForCausalLM": "moetrace.models.mixtral:MixtralForCausalLM",
    "OlmoeForCausalLM": "moetrace.models.olmoe:OlmoeForCausalLM",
    "PhiMoEForCausalLM": "moetrace.models.phimoe:PhimoeForCausalLM",  # the Hub's remote-code name
    "PhimoeForCausalLM": "moetrace.models.phimoe:PhimoeForCausalLM",
    "Qwen2MoeForCausalLM": "moetrace.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "moetrace.models.qwen3_moe:Qwen3MoeForCausalLM",
}


def model_class(architecture: str) -> type:
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)


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
    return model_class(resolve_architecture(config, source))(config)
