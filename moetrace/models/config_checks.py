"""``config.json`` read and checked before anything is built from it.

A model is sized by its config: a ``num_hidden_layers`` of 10^9 had the
loader allocate 5 GB before a memory limit stopped it, a ``vocab_size`` of
10^12 or a string ``hidden_size`` ended in tracebacks deep in torch, and an
``rms_norm_eps`` of NaN recorded garbage with exit 0.  So the file is parsed
defensively (any JSON value, any bytes) and every size the families read is
checked to be an integer in a sane range, and every number anywhere in it to
be finite, each problem in one line naming the file and the field.  What the
ranges do not catch (a shape the weights do not have, a model too big for the
device) is checked on a model built on the ``meta`` device (``preflight.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moetrace.errors import ModelError

MAX_CONFIG_BYTES = 16 << 20  # real ones are a few KB
MAX_DIM = 1 << 20  # hidden sizes, head dims, intermediate sizes
MAX_LAYERS = 1 << 12
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 16  # the trace stores ids as uint16 at most
MAX_CONTEXT = 1 << 24

# key -> (least, most) for the integer sizes any family reads; null means "not given".
_SIZES: dict[str, tuple[int, int]] = {
    "hidden_size": (1, MAX_DIM),
    "intermediate_size": (1, MAX_DIM),
    "moe_intermediate_size": (1, MAX_DIM),
    "shared_expert_intermediate_size": (0, MAX_DIM),
    "head_dim": (1, MAX_DIM),
    "num_attention_heads": (1, MAX_DIM),
    "num_key_value_heads": (1, MAX_DIM),
    "kv_lora_rank": (1, MAX_DIM),
    "q_lora_rank": (1, MAX_DIM),
    "qk_nope_head_dim": (1, MAX_DIM),
    "qk_rope_head_dim": (1, MAX_DIM),
    "v_head_dim": (1, MAX_DIM),
    "num_hidden_layers": (1, MAX_LAYERS),
    "vocab_size": (1, MAX_VOCAB),
    "num_experts": (1, MAX_EXPERTS),
    "num_local_experts": (1, MAX_EXPERTS),
    "n_routed_experts": (1, MAX_EXPERTS),
    "n_shared_experts": (0, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "n_group": (1, MAX_EXPERTS),
    "topk_group": (1, MAX_EXPERTS),
    "max_position_embeddings": (1, MAX_CONTEXT),
    "original_max_position_embeddings": (1, MAX_CONTEXT),
    "sliding_window": (0, MAX_CONTEXT),  # transformers writes 0 when it is off
    "first_k_dense_replace": (0, MAX_LAYERS),
    "decoder_sparse_step": (1, MAX_LAYERS),
    "moe_layer_freq": (1, MAX_LAYERS),
}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_POSITIVE = ("rms_norm_eps", "layer_norm_eps", "rope_theta")


def parse_config_file(config_file: Path) -> dict:
    """The JSON object in ``config_file``; one-line ``ModelError`` for anything else."""
    try:
        with config_file.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ModelError(f"{config_file}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelError(f"{config_file}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(
            f"{config_file}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})"
        ) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(
            f"{config_file}: not valid JSON ({exc.msg} at line {exc.lineno})"
        ) from None
    except RecursionError:
        raise ModelError(f"{config_file}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer with more digits than Python converts
        raise ModelError(f"{config_file}: not valid JSON ({exc})".splitlines()[0]) from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_file}: expected a JSON object, got {_json_type(config)}")
    check_config_values(config, config_file)
    return config


def check_config_values(config: dict, origin: Path | str) -> None:
    """Every size an integer in range, every number finite, top-k within the experts."""
    _check_finite(config, origin, "")
    for key, (least, most) in _SIZES.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise _field(origin, key, f"expected an integer from {least} to {most:,}", value)
    for key in _POSITIVE:
        value = config.get(key)
        if value is not None and (isinstance(value, (bool, str)) or not value > 0):
            raise _field(origin, key, "expected a positive number", value)
    experts = next((config[k] for k in _EXPERT_KEYS if config.get(k) is not None), None)
    top_k = config.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise _field(
            origin, "num_experts_per_tok", f"more than the {experts} experts there are", top_k
        )
    _check_attention_shape(config, origin)
    dense = config.get("mlp_only_layers")
    if dense is not None and not (
        isinstance(dense, list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)
    ):
        raise _field(origin, "mlp_only_layers", "expected a list of layer indices", dense)


def _check_attention_shape(config: dict, origin: Path | str) -> None:
    """Heads that split the hidden size, group evenly, and rotate in pairs (rotary embedding)."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    hidden, head_dim = config.get("hidden_size"), config.get("head_dim")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise _field(origin, "num_key_value_heads", f"does not divide {heads} heads", kv_heads)
    if (
        head_dim is None
        and hidden is not None
        and heads is not None
        and "kv_lora_rank" not in config
    ):
        if hidden % heads:
            raise _field(origin, "hidden_size", f"not a multiple of {heads} heads", hidden)
        head_dim = hidden // heads
    for key, dim in (("head_dim", head_dim), ("qk_rope_head_dim", config.get("qk_rope_head_dim"))):
        if dim is not None and dim % 2:
            raise _field(origin, key, "expected an even size (rotary pairs)", dim)


def _check_finite(value: Any, origin: Path | str, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise _field(origin, where, "expected a finite number", value)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, origin, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, origin, f"{where}[{i}]")


def _field(origin: Path | str, key: str, problem: str, value: Any) -> ModelError:
    return ModelError(f"{origin}: field '{key}': {problem}, got {_show(value)}")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "a number" if not isinstance(value, bool) else "a boolean"
