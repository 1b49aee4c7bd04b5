"""Which Hugging Face architectures moetrace can run, and how to build them."""

from __future__ import annotations

from collections.abc import Callable

from moetrace.errors import ModelError
from moetrace.models.base import MoEForCausalLM
from moetrace.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from moetrace.models.gpt_oss import GptOssForCausalLM
from moetrace.models.granitemoe import GraniteMoeForCausalLM
from moetrace.models.mixtral import MixtralForCausalLM
from moetrace.models.olmoe import OlmoeForCausalLM
from moetrace.models.phimoe import PhimoeForCausalLM
from moetrace.models.qwen2_moe import Qwen2MoeForCausalLM
from moetrace.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, Callable[[dict], MoEForCausalLM]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "PhiMoEForCausalLM": PhimoeForCausalLM,  # the remote-code name on the Hub
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
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
