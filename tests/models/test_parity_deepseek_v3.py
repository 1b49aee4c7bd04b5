"""DeepSeek-V3: recorded routing equals transformers' routers (float32, CPU).

The reference's top-k is unsorted; hf_reference re-sorts its ids by the score
they were selected on (``sigmoid + e_score_correction_bias``), which is the
order moetrace records.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.hf_reference import make_tiny_checkpoint
from support.parity import assert_mla_cuda_records_what_the_cpu_records, assert_shape_parity
from support.parity import prompts as parity_prompts

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.errors import ModelError
from moetrace.layers.moe import sigmoid_group_topk
from moetrace.models.loader import instantiate, load_model

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"

SHAPES = {
    # hf_reference's V3 defaults: 2 of 4 groups, norm_topk_prob, scaling 2.5, interleaved rope.
    "grouped-renormalised": dict(),
    # Plain q_proj, no renormalisation, rotate-half rope, no dense layer, 2 shared experts,
    # 3 of 8 groups, YaRN with mscale (the softmax scale grows by mscale²);
    # kv_lora_rank + rope dim odd, so the packed latent cache is padded.
    "raw-weights-half-rope-yarn": dict(
        q_lora_rank=None,
        kv_lora_rank=15,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_interleave=False,
        first_k_dense_replace=0,
        n_shared_experts=2,
        n_routed_experts=32,
        n_group=8,
        topk_group=3,
        num_experts_per_tok=6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


def prompts(seed: int) -> dict[str, list[int]]:
    """DeepSeek's prompt set: no short prompt, a 21-token long one."""
    return parity_prompts(seed, short=False, long=21)


@pytest.mark.parametrize("name", list(SHAPES))
def test_routing_and_greedy_tokens_match_transformers(tmp_path, name):
    assert_shape_parity(
        "deepseek_v3", tmp_path, name, SHAPES[name], prompt_set=prompts(len(name)), max_tokens=5
    )


def test_bias_picks_the_experts_and_sigmoid_weights_them():
    """A bias can select an expert with a lower score; its weight is still the unbiased one."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = sigmoid_group_topk(logits, bias, 2, 2, 1, renormalize=False)
    assert ids.tolist() == [[3, 2]]  # group {2, 3} wins on 0.5 + 5.27; order: biased score
    assert torch.allclose(weights, torch.sigmoid(torch.tensor([[-1.0, 0.0]])))


def test_real_v3_config_instantiates_on_meta():
    config = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    model = instantiate(config, "deepseek-v3", torch.bfloat16, torch.device("meta"))
    assert model.moe_layer_indices == list(range(3, 61))
    assert (model.num_experts, model.top_k) == (256, 8)
    block = model.layers[3].mlp
    assert (block.num_groups, block.topk_groups, block.scaling) == (8, 4, 2.5)
    assert block.e_score_correction_bias.dtype == torch.float32
    assert model.rope_layout == "interleaved"
    attn = model.layers[0].self_attn
    assert attn.attn.scale == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert model.rotary.attention_scaling == 1.0  # mscale / mscale_all_dim
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in model.expected_weight_names()


def test_fp8_checkpoint_tensors_are_refused():
    config = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    config = {**config, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    model = instantiate(config, "x", torch.bfloat16, torch.device("meta"))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    with pytest.raises(ModelError, match="FP8"):
        model.load_weight(name, torch.zeros(32768, 512, dtype=torch.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_records_what_the_cpu_records(tmp_path):
    """MLA in float32 on CUDA; the 16-bit fused-MoE kernel is the teacher-forced test's job."""
    ckpt = make_tiny_checkpoint(
        "deepseek_v3", tmp_path / "m", seed=4, **SHAPES["grouped-renormalised"]
    )
    assert_mla_cuda_records_what_the_cpu_records(ckpt, prompts(4), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "family, shape",
    [
        ("deepseek_v3", {}),
        ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
        ("deepseek_v2", dict(q_lora_rank=None, first_k_dense_replace=1)),  # V2-Lite's layout
    ],
)
def test_bf16_router_equals_transformers_router_teacher_forced(tmp_path, family, shape):
    """On CUDA in bf16 (MLA and experts on the kernels, decode graphs on), each layer's
    selection from the hidden states the engine fed it equals transformers' router module on
    the same states (ids re-sorted by selection score)."""
    import torch.nn.functional as F
    from support.hf_reference import RouterCall, descending_ids
    from transformers import AutoModelForCausalLM

    cuda = torch.device("cuda")
    ckpt = make_tiny_checkpoint(family, tmp_path / "m", seed=6, dtype=torch.bfloat16, **shape)
    ours = load_model(str(ckpt), device=cuda, dtype="bfloat16").model
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(cuda).eval()
    inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args: inputs.setdefault(m.moe_index, []).append(args[0].clone())
        )
        for block in ours.moe_blocks()
    ]
    eng = LLMEngine(ours, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16), cuda)
    for i, (rid, ids) in enumerate(prompts(6).items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=6, ignore_eos=True), index=i)
    list(eng.run())
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for block in ours.moe_blocks():
            layer = ours.moe_layer_indices[block.moe_index]
            x = torch.cat(inputs[block.moe_index])
            _, ids = block.select(F.linear(x.float(), block.gate))
            router = ref.model.layers[layer].mlp.gate
            logits, _, ref_ids = router(x)
            call = RouterCall(family, layer, router, x, logits, ref_ids)
            assert torch.equal(ids, descending_ids(call)), f"layer {layer}"
