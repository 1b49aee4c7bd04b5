"""DeepSeek on CUDA through the MLA and fused-MoE kernels: CUDA graphs and host syncs.

Skipped without a CUDA device.  The float32 CUDA-equals-CPU ids and the bf16
teacher-forced router checks are in ``test_parity_deepseek_v2.py`` / ``_v3.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import assert_forward_never_syncs
from support.hf_reference import make_tiny_checkpoint

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")

SHAPES = {
    # V2-Lite's layout: plain q_proj, greedy softmax routing, 2 shared experts, a dense layer.
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, first_k_dense_replace=1)),
    # V2's: q LoRA, group-limited greedy.
    "v2-group-limited": (
        "deepseek_v2",
        dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    # V3's: sigmoid scores, grouped top-k with the correction bias, interleaved rope.
    "v3": ("deepseek_v3", dict()),
}


def bf16_model(tmp_path, name: str):
    family, shape = SHAPES[name]
    ckpt = make_tiny_checkpoint(family, tmp_path / name, seed=12, dtype=torch.bfloat16, **shape)
    return load_model(str(ckpt), device=CUDA, dtype="bfloat16").model


def run(model, prompts: dict[str, list[int]], **engine) -> tuple[dict, LLMEngine]:
    config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **engine})
    eng = LLMEngine(model, config, CUDA)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True), index=i)
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return done, eng


@pytest.mark.parametrize(
    "name, expand_min_tokens",
    [(name, None) for name in SHAPES] + [("v3", 1)],
    ids=[*SHAPES, "v3-expanded-form-in-graphs"],
)
def test_graph_replay_equals_eager(tmp_path, name, expand_min_tokens):
    """bf16: every module on the kernels, so every step (padded) replays a graph; the same
    steps run eagerly at the same padded sizes must agree bit for bit, prompts included (the
    last case runs every step's prompt tokens through the expanded form, inside the graphs)."""
    from moetrace.layers.mla import MultiHeadLatentAttention

    model = bf16_model(tmp_path, name)
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention) and expand_min_tokens is not None:
            module.expand_min_tokens = expand_min_tokens
    prompts = {f"p{i}": list(range(3 + i, 40 + 2 * i)) for i in range(16)}
    eager, _ = run(model, prompts, enforce_eager=True, max_num_seqs=16)
    graph, eng = run(model, prompts, enforce_eager=False, max_num_seqs=16)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs
    assert set(eager) == set(graph)
    for rid in eager:
        np.testing.assert_array_equal(graph[rid].output_token_ids, eager[rid].output_token_ids)
        np.testing.assert_array_equal(graph[rid].routed_experts, eager[rid].routed_experts)


@pytest.mark.parametrize("kernels", ["absorbed", "expanded"])
def test_mixed_step_forward_never_syncs_the_host(tmp_path, kernels):
    """A step with a decode, a prompt and a prompt chunk, at its own size and padded as the
    runner runs it, goes through the forward with torch's sync checker raising."""
    from moetrace.layers.mla import MultiHeadLatentAttention

    model = bf16_model(tmp_path, "v3")
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.expand_min_tokens = 1 if kernels == "expanded" else None

    def prepare(eng: LLMEngine) -> None:
        eng.add_request("decoding", list(range(10, 30)), SamplingParams(max_tokens=8))
        eng.step()  # its prompt; it decodes in the next step
        eng.add_request("new", list(range(40, 60)), SamplingParams(max_tokens=4))
        eng.add_request("chunked", list(range(60, 120)), SamplingParams(max_tokens=4))

    assert_forward_never_syncs(
        model, CUDA, prepare=prepare, async_scheduling=False, max_num_batched_tokens=48
    )
