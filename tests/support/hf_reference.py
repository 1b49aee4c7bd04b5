"""Reference side of the routing-parity tests, computed with Hugging Face transformers alone.

Nothing here imports moetrace. Tiny random MoE checkpoints are built with transformers' own
config and ``XxxForCausalLM`` classes, and the reference expert ids are read from the router
modules transformers itself runs (forward hooks), so that moetrace can be checked against them.

Supported families (transformers 5.x): see ``FAMILIES``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import transformers
from torch import nn

__all__ = [
    "FAMILIES",
    "RouterCall",
    "build_tiny_model",
    "capture_router_calls",
    "descending_ids",
    "descending_weights",
    "expert_inputs",
    "forced_weights",
    "hooked_routers",
    "load_reference_model",
    "make_tiny_checkpoint",
    "perturb_routers",
    "reference_forced_logprobs",
    "reference_greedy",
    "reference_logprobs",
    "reference_routing",
    "selection_scores",
    "split_router_output",
    "topk_is_sorted",
]

# Shapes shared by every family; each family adds or overrides its own fields below.
_COMMON: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def _softmax_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


def _raw_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    return logits.double()


def _deepseek_v3_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    # DeepseekV3TopkRouter picks by sigmoid(logits) + e_score_correction_bias.
    return torch.sigmoid(logits.double()) + router.e_score_correction_bias.double()


@dataclass(frozen=True)
class _Family:
    """How one model family is built and where its router lives."""

    name: str
    config_cls: str
    model_cls: str
    # Attribute path from a decoder layer to the router; absent on dense layers.
    router_path: tuple[str, ...]
    router_cls: str
    # Score the family ranks experts by (used to put ids in descending-score order).
    selection_scores: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    # False where the modeling file calls torch.topk(..., sorted=False).
    topk_sorted: bool
    config: dict[str, Any] = field(default_factory=dict)


_FAMILIES: dict[str, _Family] = {
    "qwen3_moe": _Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        ("mlp", "gate"),
        "Qwen3MoeTopKRouter",
        _softmax_scores,
        True,
        {
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe": _Family(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        ("mlp", "gate"),
        "Qwen2MoeTopKRouter",
        _softmax_scores,
        True,
        {
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
    "olmoe": _Family(
        "olmoe",
        "OlmoeConfig",
        "OlmoeForCausalLM",
        ("mlp", "gate"),
        "OlmoeTopKRouter",
        _softmax_scores,
        True,
        {"intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2},
    ),
    "mixtral": _Family(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        ("mlp", "gate"),
        "MixtralTopKRouter",
        _softmax_scores,
        True,
        {"head_dim": 8, "intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "deepseek_v2": _Family(
        "deepseek_v2",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        ("mlp", "gate"),
        "DeepseekV2TopkRouter",
        _softmax_scores,
        False,
        {
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "topk_method": "greedy",
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
        },
    ),
    "deepseek_v3": _Family(
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        ("mlp", "gate"),
        "DeepseekV3TopkRouter",
        _deepseek_v3_scores,
        False,
        {
            "moe_intermediate_size": 16,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
            "rope_interleave": True,
        },
    ),
    "gpt_oss": _Family(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        ("mlp", "router"),
        "GptOssTopKRouter",
        _raw_scores,
        True,
        {
            "head_dim": 8,
            "intermediate_size": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            # YaRN defaults assume 4096 * 32 positions; say so to avoid a RoPE warning.
            "max_position_embeddings": 131072,
        },
    ),
    "granitemoe": _Family(
        "granitemoe",
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        ("block_sparse_moe", "router"),
        "GraniteMoeTopKRouter",
        _raw_scores,
        True,
        {
            "intermediate_size": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.25,
            "logits_scaling": 2.0,
        },
    ),
    "phimoe": _Family(
        "phimoe",
        "PhimoeConfig",
        "PhimoeForCausalLM",
        ("mlp", "router"),
        "PhimoeTopKRouter",
        # sparsemixer (eval mode) picks the max logit, then the max of the rest: top-2 by logit.
        _raw_scores,
        True,
        {"intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
}

FAMILIES: tuple[str, ...] = tuple(_FAMILIES)

_MATRIX_STD = 0.2
_EMBED_STD = 1.0
_ROUTER_LOGIT_STD = 3.0  # target spread of router logits for a unit-RMS input
_NORM_NOISE = 0.05
_BIAS_STD = 0.05


def _family(family: str) -> _Family:
    try:
        return _FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None


def _router_of(layer: nn.Module, spec: _Family) -> nn.Module | None:
    """The router module of one decoder layer, or None for a dense layer (no router attribute)."""
    module: nn.Module | None = layer
    for name in spec.router_path:
        module = getattr(module, name, None)
        if module is None:
            return None
    if type(module).__name__ != spec.router_cls:
        raise RuntimeError(
            f"expected {spec.router_cls} at {'.'.join(spec.router_path)}, found "
            f"{type(module).__name__} (transformers {transformers.__version__}); update hf_reference"
        )
    return module


def _routers(model: nn.Module, spec: _Family) -> dict[int, nn.Module]:
    layers = model.get_decoder().layers
    found = {i: _router_of(layer, spec) for i, layer in enumerate(layers)}
    return {i: r for i, r in found.items() if r is not None}


def _family_of(model: nn.Module) -> _Family:
    return _family(model.config.model_type)


@torch.no_grad()
def _reinit_(model: nn.Module, spec: _Family, seed: int) -> None:
    """Overwrite every parameter and persistent buffer with seeded, decisive random values."""
    gen = torch.Generator().manual_seed(seed)
    router_weights = {id(r.weight) for r in _routers(model, spec).values()}
    hidden = model.config.hidden_size
    seen: set[int] = set()
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        if id(tensor) in seen or not tensor.is_floating_point():
            continue
        seen.add(id(tensor))
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if id(tensor) in router_weights:
            value = noise * (_ROUTER_LOGIT_STD / math.sqrt(hidden))
        elif "bias" in leaf:
            value = noise * _BIAS_STD
        elif "norm" in name and tensor.dim() == 1:
            value = 1.0 + noise * _NORM_NOISE
        elif "embed" in name:
            value = noise * _EMBED_STD
        elif tensor.dim() >= 2:
            value = noise * _MATRIX_STD
        else:
            value = noise * _BIAS_STD
        tensor.copy_(value.to(tensor.dtype))


def _keep_strict_fp32_(model: nn.Module) -> None:
    """Hold ``_keep_in_fp32_modules_strict`` tensors in float32, as from_pretrained loads them.

    (DeepSeek router weight and e_score_correction_bias; some 5.x from_config miss the buffer.)
    """
    patterns = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if tensor.is_floating_point() and any(p in name for p in patterns):
            tensor.data = tensor.data.float()


def build_tiny_model(
    family: str, *, seed: int, dtype: torch.dtype = torch.float32, **config_overrides: Any
) -> transformers.PreTrainedModel:
    """A tiny random ``XxxForCausalLM`` of ``family`` with seeded, decisive weights (eval mode)."""
    spec = _family(family)
    config_cls = getattr(transformers, spec.config_cls)
    config = config_cls(**{**_COMMON, **spec.config, **config_overrides})
    # from_config honours the family's _keep_in_fp32_modules_strict (DeepSeek router weights).
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if type(model).__name__ != spec.model_cls:
        raise RuntimeError(f"{family}: built {type(model).__name__}, expected {spec.model_cls}")
    _keep_strict_fp32_(model)
    _reinit_(model, spec, seed)
    return model.eval()


def _hub_style(config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-5 config.json dict with the key names published checkpoints use."""
    out = dict(config)
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    rope = dict(out.pop("rope_parameters", None) or {})
    if rope:
        out["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") == "default" and set(rope) <= {"rope_type"}:
            out["rope_scaling"] = None
        else:
            out["rope_scaling"] = rope
    if out.get("model_type") == "qwen3_moe" and "num_local_experts" in out:
        # Qwen3MoeConfig.attribute_map writes num_experts as num_local_experts; the Hub has num_experts.
        out["num_experts"] = out.pop("num_local_experts")
    return out


def make_tiny_checkpoint(
    family: str,
    out_dir: Path,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    config_style: Literal["transformers", "hub"] = "transformers",
    **config_overrides: Any,
) -> Path:
    """Save a tiny random checkpoint (config.json + model.safetensors) and return ``out_dir``.

    ``config_style="transformers"`` keeps config.json exactly as ``save_pretrained`` wrote it
    (transformers 5: ``dtype``, ``rope_parameters``; qwen3_moe: ``num_local_experts``);
    ``"hub"`` rewrites those keys the way published checkpoints spell them (``torch_dtype``,
    ``rope_theta``/``rope_scaling``, qwen3_moe ``num_experts``). Both load to the same model.
    """
    out_dir = Path(out_dir)
    model = build_tiny_model(family, seed=seed, dtype=dtype, **config_overrides)
    model.save_pretrained(out_dir, safe_serialization=True)
    if config_style == "hub":
        path = out_dir / "config.json"
        config = _hub_style(json.loads(path.read_text()))
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    elif config_style != "transformers":
        raise ValueError(f"unknown config_style {config_style!r}")
    return out_dir


def load_reference_model(
    checkpoint_dir: Path, *, dtype: torch.dtype = torch.float32
) -> transformers.PreTrainedModel:
    """Load a checkpoint with transformers' plainest code paths (eager attention, eval mode)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint_dir),
        dtype=dtype,
        attn_implementation="eager",
        # The per-expert loop of the modeling file, not the grouped_mm kernel.
        experts_implementation="eager",
    )
    return model.eval()


@dataclass
class RouterCall:
    """One call of a router module, as seen by forward hooks."""

    family: str
    layer_idx: int
    router: nn.Module
    inputs: torch.Tensor  # (tokens, hidden)
    logits: torch.Tensor  # (tokens, experts)
    indices: torch.Tensor  # (tokens, top_k), exactly as the router returned them
    weights: torch.Tensor  # (tokens, top_k): what the experts' outputs are multiplied by


def _split_router_output(
    router: nn.Module, output: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router_logits, selected ids, their weights) from a router's output tuple, found by
    dtype and width.

    Not by position: transformers 5.24 routers return ``(logits, weights, ids)``, but e.g.
    GraniteMoeTopKRouter in 5.17 returns ``(ids, weights, logits)``.
    """
    if not isinstance(output, tuple):
        raise RuntimeError(
            f"{type(router).__name__} returned {type(output).__name__}; expected a tuple "
            "holding (router_logits, weights, indices) as transformers 5.x routers do"
        )
    num_experts = router.weight.shape[0]
    ints = [t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    floats = [
        t
        for t in output
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] == num_experts
    ]
    if len(ints) != 1 or len(floats) != 1:  # also refuses top_k == num_experts (ambiguous)
        raise RuntimeError(f"cannot find logits and ids in {type(router).__name__} output")
    top_k = ints[0].shape[-1]
    weights = [
        t
        for t in output
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] == top_k
    ]
    if len(weights) != 1:
        raise RuntimeError(f"cannot find the weights in {type(router).__name__} output")
    return floats[0], ints[0], weights[0]


def split_router_output(
    router: nn.Module, output: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router_logits, selected ids, their weights) from a router's output, whatever its order."""
    return _split_router_output(router, output)


@contextmanager
def hooked_routers(model: nn.Module) -> Iterator[list[RouterCall]]:
    """Every router call of the forwards run inside the block, as the routers returned it."""
    spec = _family_of(model)
    calls: list[RouterCall] = []

    def make_hook(layer_idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            logits, indices, weights = _split_router_output(module, output)
            hidden = args[0].reshape(-1, args[0].shape[-1])
            calls.append(
                RouterCall(
                    family=spec.name,
                    layer_idx=layer_idx,
                    router=module,
                    inputs=hidden.detach().clone(),
                    logits=logits.detach().reshape(hidden.shape[0], -1).clone(),
                    indices=indices.detach().reshape(hidden.shape[0], -1).clone(),
                    weights=weights.detach().reshape(hidden.shape[0], -1).clone(),
                )
            )

        return hook

    handles = [r.register_forward_hook(make_hook(i)) for i, r in _routers(model, spec).items()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_router_calls(model: nn.Module, token_ids: list[int]) -> list[RouterCall]:
    """Run one full forward (batch 1, no cache) and return every router call in layer order."""
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    with hooked_routers(model) as calls:
        model(input_ids=input_ids, use_cache=False)
    return list(calls)


def selection_scores(call: RouterCall) -> torch.Tensor:
    """(tokens, experts) float64 scores the family's router ranks experts by, from its logits."""
    return _family(call.family).selection_scores(call.router, call.logits)


def topk_is_sorted(family: str) -> bool:
    """Whether the family's router returns ids already in descending-score order."""
    return _family(family).topk_sorted


def _descending_order(call: RouterCall) -> torch.Tensor:
    scores = selection_scores(call).gather(1, call.indices)
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def descending_ids(call: RouterCall) -> torch.Tensor:
    """The call's ids reordered by descending selection score (stable: ties keep router order)."""
    return call.indices.gather(1, _descending_order(call))


def descending_weights(call: RouterCall) -> torch.Tensor:
    """The call's weights in the order of ``descending_ids`` (each stays with its id)."""
    return call.weights.gather(1, _descending_order(call))


def reference_routing(
    checkpoint_dir: Path, token_ids: list[int], *, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Top-k expert ids transformers' routers choose for ``token_ids``.

    Returns ``{"moe_layer_indices": [...], "topk_ids": int64 array (tokens, moe_layers, top_k),
    "topk_weights": the routers' weights of those ids, float64, same shape and order}``;
    ids are in descending router-score order (the order ``torch.topk(sorted=True)`` returns).
    DeepSeek V2/V3 call ``torch.topk(..., sorted=False)``, so their hooked ids are re-sorted by
    the score they were selected on (V3: ``sigmoid(logits) + e_score_correction_bias``).
    """
    model = load_reference_model(checkpoint_dir, dtype=dtype)
    spec = _family_of(model)
    moe_layers = sorted(_routers(model, spec))
    calls = capture_router_calls(model, token_ids)
    if [c.layer_idx for c in calls] != moe_layers:
        raise RuntimeError(
            f"router calls {[c.layer_idx for c in calls]} != MoE layers {moe_layers}"
        )
    per_layer = [descending_ids(c).cpu().numpy() for c in calls]
    topk_ids = np.stack(per_layer, axis=1).astype(np.int64)
    weights = [descending_weights(c).double().cpu().numpy() for c in calls]
    return {
        "moe_layer_indices": moe_layers,
        "topk_ids": topk_ids,
        "topk_weights": np.stack(weights, axis=1),
    }


@torch.no_grad()
def reference_logprobs(
    checkpoint_dir: Path, token_ids: list[int], *, dtype: torch.dtype = torch.float32
) -> np.ndarray:
    """float64 ``(len(token_ids) - 1,)``: log-probability of token ``i + 1`` given tokens 0..i,
    from one full forward of transformers' model (log-softmax of its logits in float64)."""
    model = load_reference_model(checkpoint_dir, dtype=dtype)
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].double()
    targets = input_ids[0, 1:, None]
    return logits.log_softmax(dim=-1).gather(1, targets)[:, 0].cpu().numpy()


@torch.no_grad()
def reference_greedy(
    checkpoint_dir: Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> list[int]:
    """Exactly ``max_new_tokens`` greedy tokens from ``model.generate`` (EOS never stops it)."""
    model = load_reference_model(checkpoint_dir, dtype=dtype)
    pad = model.config.pad_token_id
    gen_config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0 if pad is None else pad,
    )
    # generate() fills unset fields from model.generation_config (eos included): replace it.
    model.generation_config = gen_config
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=gen_config,
        use_cache=True,
    )
    new = out[0, len(prompt_ids) :].tolist()
    if len(new) != max_new_tokens:
        raise RuntimeError(f"generate returned {len(new)} new tokens, wanted {max_new_tokens}")
    return new


# -- routing replay on transformers' side: perturbed routers, forced experts --------------


@torch.no_grad()
def perturb_routers(checkpoint_dir: Path, out_dir: Path, *, scale: float, seed: int) -> Path:
    """A copy of a checkpoint whose router weights have seeded noise of ``scale`` x their std
    added (everything else unchanged), saved by transformers."""
    model = load_reference_model(checkpoint_dir)
    gen = torch.Generator().manual_seed(seed)
    for router in _routers(model, _family_of(model)).values():
        w = router.weight
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32) * float(w.std()) * scale
        w.add_(noise.to(w.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


@dataclass
class ExpertCall:
    """What one MoE layer's experts module was called with: the ids and weights it applied."""

    layer_idx: int
    ids: torch.Tensor  # (tokens, top_k)
    weights: torch.Tensor  # (tokens, top_k)


@contextmanager
def expert_inputs(model: nn.Module) -> Iterator[list[ExpertCall]]:
    """The ids and weights each MoE block hands its ``experts`` module (forward pre-hooks), read
    at the experts' own call: what they compute with, whatever changed the router's choice."""
    spec = _family_of(model)
    calls: list[ExpertCall] = []

    def make_hook(layer_idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            _, ids, weights = args[:3]  # (hidden_states, top_k_index, top_k_weights)
            calls.append(ExpertCall(layer_idx, ids.detach().clone(), weights.detach().clone()))

        return hook

    layers = model.get_decoder().layers
    handles = []
    for i in _routers(model, spec):
        block = layers[i]
        for name in spec.router_path[:-1]:
            block = getattr(block, name)
        handles.append(block.experts.register_forward_pre_hook(make_hook(i)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def forced_weights(family: str, router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    """The weight each family's router would give ``ids`` (routing replay), from its logits,
    written from the modeling files' router code (not from moetrace)."""
    return _forced_weights(family, router, logits, ids)


def _forced_weights(family: str, router: nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    """The weight each family's router would give ``ids`` (routing replay), from its logits,
    written from the modeling files' router code (not from moetrace)."""
    if family in ("qwen3_moe", "qwen2_moe", "olmoe"):
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w = probs.gather(1, ids)
        if router.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype)
    if family == "mixtral":
        w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True)
    if family == "granitemoe":
        return torch.softmax(logits.float().gather(1, ids), dim=-1)
    if family == "gpt_oss":
        values = logits.gather(1, ids)
        return torch.softmax(values, dim=1, dtype=values.dtype)
    if family == "deepseek_v3":
        w = logits.sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    if family == "deepseek_v2":
        return logits.softmax(dim=-1, dtype=torch.float32).gather(1, ids) * (
            router.routed_scaling_factor
        )
    if family == "phimoe":
        # The sparsemixer's eval computation with each forced pick in place of its max: the
        # logits within a relative 2 * jitter of the pick (the second without the first) are
        # softmaxed and the pick's share taken.  For the picks it makes itself, its own.
        eps = router.router_jitter_noise
        first, second = ids[:, :1], ids[:, 1:]
        threshold = logits.gather(-1, first)
        factor = logits.abs().clamp(min=threshold)
        gates = logits.masked_fill((threshold - logits) / factor > 2 * eps, float("-inf"))
        w_first = torch.softmax(gates, dim=-1).gather(-1, first)
        masked = torch.scatter(logits, -1, first, float("-inf"))
        threshold = masked.gather(-1, second)
        factor = logits.abs().clamp(min=threshold)
        gates = masked.masked_fill((threshold - logits) / factor > 2 * eps, float("-inf"))
        return torch.cat((w_first, torch.softmax(gates, dim=-1).gather(-1, second)), dim=-1)
    raise ValueError(f"no forced-weight rule for {family!r}")


@torch.no_grad()
def reference_forced_logprobs(
    model: transformers.PreTrainedModel, token_ids: list[int], forced_ids: np.ndarray
) -> np.ndarray:
    """Like ``reference_logprobs`` (from a ``load_reference_model``), with every router's ids
    replaced by ``forced_ids`` (``[len - 1, moe_layers, top_k]``) and its weights recomputed
    over them by the family's rule: forward hooks on transformers' own router modules."""
    spec = _family_of(model)
    routers = _routers(model, spec)

    def make_hook(moe_index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            logits, indices, weights = _split_router_output(module, output)
            logits = logits.reshape(-1, logits.shape[-1])
            ids = torch.as_tensor(forced_ids[:, moe_index], dtype=indices.dtype)
            new_weights = _forced_weights(spec.name, module, logits, ids).to(weights.dtype)
            swap = {id(indices): ids.reshape(indices.shape), id(weights): new_weights}
            return tuple(swap.get(id(t), t) for t in output)

        return hook

    handles = [r.register_forward_hook(make_hook(i)) for i, r in enumerate(routers.values())]
    try:
        input_ids = torch.tensor([token_ids[:-1]], dtype=torch.long)
        logits = model(input_ids=input_ids, use_cache=False).logits[0].double()
    finally:
        for handle in handles:
            handle.remove()
    targets = torch.tensor(token_ids[1:], dtype=torch.long)[:, None]
    return logits.log_softmax(dim=-1).gather(1, targets)[:, 0].numpy()
