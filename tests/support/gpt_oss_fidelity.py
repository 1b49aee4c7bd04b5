"""bf16 fidelity of gpt-oss against transformers: the models, the runs and the figures.

A transformers ``GptOssForCausalLM`` and a moetrace one share random weights of
real scale (experts drawn as MXFP4 codes: moetrace keeps the codes,
transformers gets their exact bf16 values).  Two comparisons:

* layer-forced: every moetrace layer is fed the hidden states transformers'
  same layer received, so each layer's routing is compared alone, without
  the drift earlier layers add;
* free-running: both models read the same tokens and compute their own hidden
  states (the figure a user sees when comparing traces).

Run on CUDA by ``tests/models/test_gpu_gpt_oss.py``; the plumbing also runs on the
CPU at small widths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import transformers

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.layers.mxfp4 import dequantize_mxfp4
from moetrace.layers.residual import total
from moetrace.models.loader import instantiate

# gpt-oss-20b's widths, heads, experts and window; fewer layers and a small vocabulary.
REAL_WIDTH = {
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "vocab_size": 4096,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
}


@dataclass
class Twins:
    reference: transformers.PreTrainedModel
    ours: torch.nn.Module


@torch.no_grad()
def build_twins(shape: dict, device: torch.device, seed: int = 0) -> Twins:
    """transformers' model and ours on ``device`` in bf16 with the same weights.

    Matrices N(0, 0.02), norms 1 + N(0, 0.05), biases N(0, 0.05), sinks N(0, 1),
    experts MXFP4 codes with scales putting their RMS near 0.023.
    """
    hf_config = transformers.GptOssConfig(**shape)
    with device:
        ref = transformers.AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.bfloat16, attn_implementation="eager"
        ).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    mxfp4: dict[str, torch.Tensor] = {}
    for name, param in ref.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            _random_mxfp4_experts(name, param, gen, mxfp4)
        elif "norm" in name:
            param.copy_(1 + 0.05 * torch.randn(param.shape, generator=gen, device=device))
        elif name.endswith("sinks"):
            param.normal_(0.0, 1.0, generator=gen)
        elif name.endswith("bias"):
            param.normal_(0.0, 0.05, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    config = {
        **hf_config.to_dict(),
        "architectures": ["GptOssForCausalLM"],
        "quantization_config": {"quant_method": "mxfp4"},
    }
    ours = instantiate(config, "gpt-oss fidelity twin", torch.bfloat16, device)
    wanted = ours.expected_weight_names()
    for name, tensor in {**ref.state_dict(), **mxfp4}.items():
        if name in wanted:
            ours.load_weight(name, tensor)
    return Twins(ref, ours)


def _random_mxfp4_experts(
    name: str, param: torch.Tensor, gen: torch.Generator, out: dict[str, torch.Tensor]
) -> None:
    """Random MXFP4 codes for one expert matrix; ``param`` gets their exact values."""
    experts, k, n = param.shape  # transformers keeps [E, in, out]
    device = param.device
    blocks = torch.randint(0, 256, (experts, n, k // 32, 16), generator=gen, device=device)
    scales = torch.randint(119, 122, (experts, n, k // 32), generator=gen, device=device)
    blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
    for e in range(experts):
        param[e].copy_(dequantize_mxfp4(blocks[e], scales[e], param.dtype).T)
    out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales


@torch.no_grad()
def reference_pass(ref: transformers.PreTrainedModel, sequences: list[list[int]]) -> dict:
    """One forward over equal-length sequences: each layer's input and router ids and logits."""
    layers = ref.model.layers
    inputs, ids, logits = {}, {}, {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(
            layer.register_forward_pre_hook(
                lambda m, args, i=i: inputs.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]))
            )
        )

        def router_hook(module, args, output, i=i):
            logits[i], _, ids[i] = output

        hooks.append(layer.mlp.router.register_forward_hook(router_hook))
    try:
        tokens = torch.tensor(sequences, device=ref.device)
        ref(input_ids=tokens, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {"inputs": inputs, "ids": ids, "logits": logits}


def set_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows whose top-k sets are equal (order inside a row aside)."""
    return float((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1).mean())


def differing_margins(
    ours: np.ndarray, ref_ids: torch.Tensor, ref_logits: torch.Tensor
) -> np.ndarray:
    """For rows whose sets differ: the reference's gap between its k-th and (k+1)-th logit,
    in units of that row's logit standard deviation (a near-tie is a small gap)."""
    k = ref_ids.shape[-1]
    logits = ref_logits.float()
    top = logits.topk(k + 1, dim=-1).values
    gap = ((top[:, k - 1] - top[:, k]) / logits.std(dim=-1)).cpu().numpy()
    differ = ~(np.sort(ours, -1) == np.sort(ref_ids.cpu().numpy(), -1)).all(-1)
    return gap[differ]


def layer_forced_rows(
    ours: torch.nn.Module, sequence: list[int], layer_inputs: dict, device: torch.device, **engine
) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
    """Our rows for ``sequence`` in one prefill step, each layer fed transformers' input to it,
    and each layer's router input (``{layer: [len(sequence), hidden]}``) in that step.

    The hooks go on only once the engine is built: on the kernels its start-up
    runs every padded step size (1 token, 2, ...) to compile them, which
    neither fit transformers' inputs nor are the step compared.  The step
    itself may be padded to a captured size: padding rows follow the
    sequence's and keep their own inputs.
    """
    n = len(sequence)
    router_inputs: dict[int, torch.Tensor] = {}

    def force(args, i):
        # A layer takes (its predecessor's output, the stream before it): the stream it
        # reads is their sum, so the forced stream goes in whole, with no residual.
        out, residual, *rest = args
        x = total(out).clone() if residual is None else residual + total(out)
        x[:n] = layer_inputs[i]
        return (x, None, *rest)

    eng = start_engine(ours, [sequence], 1, device, **engine)
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, i=i: force(args, i))
        for i, layer in enumerate(ours.layers)
    ] + [
        layer.mlp.register_forward_pre_hook(
            lambda m, args, i=i: router_inputs.__setitem__(i, args[0][:n].clone())
        )
        for i, layer in enumerate(ours.layers)
    ]
    try:
        done = finish_engine(eng, 1)
    finally:
        for h in hooks:
            h.remove()
    return done[0].routed_experts[:n], router_inputs


def start_engine(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, device, **engine
) -> LLMEngine:
    """An engine on ``model`` holding greedy requests for every prompt (EOS ignored)."""
    longest = max(len(p) for p in prompts) + max_tokens
    config = EngineConfig(
        **{"num_kv_blocks": len(prompts) * (longest // 16 + 2) + 8, "block_size": 16, **engine}
    )
    eng = LLMEngine(model, config, device)
    for i, ids in enumerate(prompts):
        eng.add_request(
            str(i), ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), index=i
        )
    return eng


def finish_engine(eng: LLMEngine, num_prompts: int) -> list:
    """Run ``eng`` to the end; finished requests in prompt order."""
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return [done[str(i)] for i in range(num_prompts)]


def run_engine(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, device, **engine
) -> list:
    """Greedy runs of every prompt (EOS ignored); finished requests in prompt order."""
    return finish_engine(start_engine(model, prompts, max_tokens, device, **engine), len(prompts))
