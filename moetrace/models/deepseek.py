"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).

Both: multi-head latent attention (``layers/mla.py``), the first
``first_k_dense_replace`` layers dense (no routing rows), every later layer
routed experts plus always-on shared experts, a router kept in float32 as the
reference keeps it.  They differ in routing and rope layout:

- V2: softmax scores, ``greedy`` or ``group_limited_greedy`` top-k, weights
  times ``routed_scaling_factor``; rope on complex pairs in float32.
- V3: sigmoid scores; experts chosen by ``sigmoid + e_score_correction_bias``
  within the ``topk_group`` best groups, weighted by the unbiased sigmoid
  (renormalised if ``norm_topk_prob``) times ``routed_scaling_factor``; rope
  interleaved (``rope_interleave``, default) or rotate-half.

Recorded ids are in descending selection score: the reference's
``topk(sorted=False)`` order is unspecified, so the trace sorts it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.errors import ModelError
from moetrace.layers.mla import MLADims, MultiHeadLatentAttention, Rope, mla_softmax_scale
from moetrace.layers.moe import (
    ACTIVATIONS,
    MoEExperts,
    RoutingRule,
    group_limited_softmax_topk,
    sigmoid_group_topk,
    sigmoid_weights,
    softmax_topk,
    softmax_weights,
)
from moetrace.layers.norm import RMSNorm
from moetrace.layers.residual import SubLayerOutput, add_norm, plus
from moetrace.layers.rotary import RotaryEmbedding, rope_settings
from moetrace.models.base import MoEBlockBase
from moetrace.models.common import DecoderLM, feed_forward, map_experts, map_norms
from moetrace.models.weights import WeightMap

# transformers' config defaults for the routing keys a config.json may leave out.
_V2_DEFAULTS = {"routed_scaling_factor": 1.0, "topk_method": "greedy", "n_shared_experts": 2}
_V3_DEFAULTS = {
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "rope_interleave": True,
}
_SCORING = {2: "softmax", 3: "sigmoid"}


def _setting(config: dict, version: int, key: str) -> Any:
    """The config's value (null included), else transformers' default for the family."""
    defaults = _V2_DEFAULTS if version == 2 else _V3_DEFAULTS
    return config[key] if key in config else defaults.get(key)


def check_config(config: dict, version: int) -> None:
    """Refuse what transformers and DeepSeek's own code would compute differently."""
    name = f"DeepSeek-V{version}"
    if not config.get("n_routed_experts"):
        raise ModelError(f"{name}: n_routed_experts is not set (no routed experts to record)")
    if int(config.get("moe_layer_freq", 1) or 1) != 1:
        raise ModelError(f"{name}: moe_layer_freq != 1 is not supported")
    scoring = config.get("scoring_func", _SCORING[version])
    if scoring != _SCORING[version]:
        raise ModelError(f"{name}: scoring_func {scoring!r} is not supported")
    method = _setting(config, version, "topk_method")
    if method not in (("greedy", "group_limited_greedy") if version == 2 else (None, "noaux_tc")):
        raise ModelError(f"{name}: topk_method {method!r} is not supported")
    if config.get("hidden_act", "silu") not in ACTIVATIONS:
        raise ModelError(f"{name}: hidden_act {config.get('hidden_act')!r} is not supported")


def deepseek_moe_layer_indices(config: dict) -> list[int]:
    first_dense = int(config.get("first_k_dense_replace", 0) or 0)
    return list(range(first_dense, config["num_hidden_layers"]))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; gate and up fused, biases only where V2's ``mlp_bias``."""

    def __init__(self, hidden: int, intermediate: int, activation: str, *, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.act = ACTIVATIONS[activation]
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class DeepseekMoE(MoEBlockBase):
    can_keep_rows = True  # routed rows plus the shared experts: ``plus`` keeps them apart

    def __init__(self, config: dict, version: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        experts = config["n_routed_experts"]
        inter = config["moe_intermediate_size"]
        act = config.get("hidden_act", "silu")
        self.version = version
        self.top_k = config["num_experts_per_tok"]
        self.scaling = float(_setting(config, version, "routed_scaling_factor"))
        self.topk_method = _setting(config, version, "topk_method") if version == 2 else "noaux_tc"
        self.num_groups = int(_setting(config, version, "n_group") or 1)
        self.topk_groups = int(_setting(config, version, "topk_group") or 1)
        self.renormalize = bool(_setting(config, version, "norm_topk_prob"))
        if self.topk_method != "greedy" and experts % self.num_groups:
            raise ModelError(f"n_routed_experts {experts} is not a multiple of n_group")
        # The router stays float32 in any model dtype, as the reference keeps it.
        self.gate = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32))
        if version == 3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))
        self.experts = MoEExperts(experts, hidden, inter, act)
        if version == 2 and self.topk_method == "greedy":
            self.routing_rule = RoutingRule("softmax_topk")
        shared = int(_setting(config, version, "n_shared_experts") or 0)
        bias = bool(config.get("mlp_bias", False)) and version == 2
        self.shared_experts = GatedMLP(hidden, inter * shared, act, bias=bias) if shared else None

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) from float32 router logits; ids in descending selection score.

        V2 ignores ``norm_topk_prob`` as transformers' DeepseekV2 does.
        """
        if self.version == 3:
            return sigmoid_group_topk(
                logits,
                self.e_score_correction_bias,
                self.top_k,
                self.num_groups,
                self.topk_groups,
                renormalize=self.renormalize,
            )
        if self.topk_method == "group_limited_greedy":
            return group_limited_softmax_topk(logits, self.top_k, self.num_groups, self.topk_groups)
        return softmax_topk(logits, self.top_k, renormalize=False)

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """V3: sigmoid scores of ``ids`` (renormalised); V2: their softmax shares."""
        if self.version == 3:
            return sigmoid_weights(logits, ids, renormalize=self.renormalize)
        return softmax_weights(logits, ids, renormalize=False)

    def forward(self, x: torch.Tensor, *, keep_rows: bool = False) -> SubLayerOutput:
        logits = F.linear(x.to(torch.float32), self.gate)
        weights, ids = self.route_and_record(logits, torch.float32, scaling=self.scaling)
        out = self.experts(x, weights, ids, keep_rows=keep_rows)
        if self.shared_experts is not None:
            out = plus(out, self.shared_experts(x))
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: dict, version: int, is_moe: bool, dims: MLADims, scale: float
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MultiHeadLatentAttention(
            dims, scale, bias=bool(config.get("attention_bias", False))
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        act = config.get("hidden_act", "silu")
        bias = bool(config.get("mlp_bias", False)) and version == 2
        self.mlp: nn.Module = (
            DeepseekMoE(config, version)
            if is_moe
            else GatedMLP(hidden, config["intermediate_size"], act, bias=bias)
        )

    def forward(
        self, x: SubLayerOutput, residual: torch.Tensor | None, rope: Rope
    ) -> tuple[SubLayerOutput, torch.Tensor]:
        """As ``PreNormDecoderLayer``: the adds are the next norm's (``add_norm``)."""
        h, residual = add_norm(self.input_layernorm, x, residual)
        h, residual = add_norm(self.post_attention_layernorm, self.self_attn(h, rope), residual)
        return feed_forward(self.mlp, h), residual


class DeepseekForCausalLM(DecoderLM):
    version: int = 0

    def __init__(self, config: dict) -> None:
        super().__init__()
        check_config(config, self.version)
        self.config = config
        hidden = config["hidden_size"]
        # Registered first: the engine reads the model dtype from the first parameter.
        self._init_embedding(config)
        self.num_experts = config["n_routed_experts"]
        self.top_k = config["num_experts_per_tok"]
        self.moe_layer_indices = deepseek_moe_layer_indices(config)
        self.max_model_len = int(config.get("max_position_embeddings", 4096))
        dims = MLADims(
            hidden=hidden,
            num_heads=config["num_attention_heads"],
            q_lora_rank=config.get("q_lora_rank", 1536),
            kv_lora_rank=config["kv_lora_rank"],
            nope_dim=config["qk_nope_head_dim"],
            rope_dim=config["qk_rope_head_dim"],
            v_dim=config["v_head_dim"],
        )
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            dims.rope_dim, theta, scaling, max_position_embeddings=self.max_model_len
        )
        self.rope_layout = "complex" if self.version == 2 else "half"
        if self.version == 3 and _setting(config, 3, "rope_interleave"):
            self.rope_layout = "interleaved"
        scale = mla_softmax_scale(dims.qk_dim, scaling)
        moe = set(self.moe_layer_indices)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, self.version, i in moe, dims, scale)
            for i in range(config["num_hidden_layers"])
        )
        self._init_head(config, RMSNorm(hidden, config.get("rms_norm_eps", 1e-6)))

    def position_encoding(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Rope]:
        """One rope function for every layer's MLA, in this version's pair layout."""
        if self.rope_layout == "complex":
            rotations = self.rotary.rotations(positions)
            return (lambda x: RotaryEmbedding.apply_complex(x, rotations),)
        cos, sin = self.rotary.cos_sin(positions, dtype)
        if self.rope_layout == "interleaved":
            return (lambda x: RotaryEmbedding.apply_interleaved(x, cos, sin),)
        return (lambda x: RotaryEmbedding.apply(x, cos, sin),)

    def _map_layer(self, wm: WeightMap, i: int, layer: nn.Module, src: str, dst: str) -> None:
        for name, _ in layer.self_attn.named_parameters():
            if not name.startswith("attn."):
                wm.direct(f"{src}self_attn.{name}", f"{dst}self_attn.{name}")
        map_norms(wm, layer, src, dst)
        mlp = layer.mlp
        if not isinstance(mlp, DeepseekMoE):
            _map_gated(wm, mlp, src + "mlp.", dst + "mlp.")
            return
        wm.direct(f"{src}mlp.gate.weight", f"{dst}mlp.gate")
        if mlp.version == 3:
            wm.direct(f"{src}mlp.gate.e_score_correction_bias", f"{dst}mlp.e_score_correction_bias")
        map_experts(wm, mlp.experts, f"{src}mlp.experts.", f"{dst}mlp.experts.")
        if mlp.shared_experts is not None:
            _map_gated(
                wm, mlp.shared_experts, f"{src}mlp.shared_experts.", f"{dst}mlp.shared_experts."
            )

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ModelError(
                f"tensor {name!r} is {tensor.dtype}: FP8 block-quantized checkpoints are not "
                "supported; convert to bfloat16 first (DeepSeek's fp8_cast_bf16.py)"
            )
        return super().load_weight(name, tensor)


def _map_gated(wm: WeightMap, mlp: GatedMLP, src: str, dst: str) -> None:
    inter = mlp.intermediate
    for kind in ("weight", "bias"):
        if getattr(mlp.gate_up, kind) is None:
            continue
        wm.rows(f"{src}gate_proj.{kind}", f"{dst}gate_up.{kind}", 0, inter)
        wm.rows(f"{src}up_proj.{kind}", f"{dst}gate_up.{kind}", inter, inter)
        wm.direct(f"{src}down_proj.{kind}", f"{dst}down.{kind}")


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    architecture = "DeepseekV2ForCausalLM"
    version = 2


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    architecture = "DeepseekV3ForCausalLM"
    version = 3
