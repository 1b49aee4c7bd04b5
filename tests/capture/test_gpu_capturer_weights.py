"""Gate weights on CUDA: captured inside the graphs, equal to eager and to transformers' routers.

Skipped without a CUDA device (the lead runs them on the H200).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import shared_prefix_prompts
from support.gpu_engine import CUDA, gpu_model, mixed_workload, run, run_counting

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("weights", ["float16", "float32"])
def test_weights_from_graph_replay_equal_eager_and_leave_the_rest_unchanged(weights):
    model = gpu_model(torch.bfloat16)
    prompts, max_tokens = mixed_workload(seed=31, count=24)
    engine = dict(max_num_seqs=8, max_num_batched_tokens=64)
    eager, eager_kinds, _ = run_counting(
        model, prompts, max_tokens, enforce_eager=True, capture_weights=weights, **engine
    )
    graph, kinds, _ = run_counting(model, prompts, max_tokens, capture_weights=weights, **engine)
    bare, _, _ = run_counting(model, prompts, max_tokens, **engine)
    # The same kernels both times: replayed from the graphs here, launched one by one there.
    assert kinds.get("mixed/graph", 0) >= 5 and kinds.get("decode/graph", 0) >= 5, kinds
    assert not any(kind.endswith("/graph") for kind in eager_kinds), eager_kinds
    for rid in prompts:
        a, b, c = eager[rid], graph[rid], bare[rid]
        np.testing.assert_array_equal(a.routed_weights, b.routed_weights, err_msg=rid)
        assert b.routed_weights.dtype == np.dtype(weights) and (b.routed_weights > 0).all()
        for done in (a, b):  # weights on: the same ids and tokens as without
            np.testing.assert_array_equal(done.routed_experts, c.routed_experts, err_msg=rid)
            np.testing.assert_array_equal(done.output_token_ids, c.output_token_ids, err_msg=rid)
        assert c.routed_weights is None


def test_bf16_weights_equal_transformers_router_teacher_forced(tmp_path):
    """The kernel-written weights of each layer are the ones transformers' router returns for
    the same hidden states (bf16 values, exact in float16)."""
    from support.hf_reference import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from moetrace.models.loader import load_model

    ckpt = make_tiny_checkpoint(
        "qwen3_moe", tmp_path / "ckpt", seed=3, dtype=torch.bfloat16, norm_topk_prob=False
    )
    ours = load_model(str(ckpt), device=CUDA, dtype="bfloat16").model
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(CUDA).eval()
    seq = list(range(5, 70))
    # Eager (padded, the graphs' kernels and shapes): hooks see the layers' inputs.
    config = EngineConfig(num_kv_blocks=64, capture_weights="float16", enforce_eager=True)
    eng = LLMEngine(ours, config, CUDA)
    assert eng.runner.graphs is not None and eng.runner.capturer.in_kernel
    eng.add_request("a", seq, SamplingParams(max_tokens=1))
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args, i=block.moe_index: inputs.__setitem__(i, args[0][: len(seq)].clone())
        )
        for block in ours.moe_blocks()
    ]
    (done,) = list(eng.run())
    for h in hooks:
        h.remove()
    layers = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")]
    for moe_index, layer in enumerate(layers):
        with torch.inference_mode():
            _, ref_weights, ref_ids = ref.model.layers[layer].mlp.gate(inputs[moe_index])
        same = (ref_ids.cpu().numpy() == done.routed_experts[:, moe_index]).all(axis=1)
        assert same.mean() > 0.95, layer
        want = ref_weights.float().cpu().numpy()[same]
        got = done.routed_weights[:, moe_index][same].astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")


def test_weights_capture_never_syncs_the_host():
    """The padded forward with weights capture on, and the transfer, with torch's sync
    checker set to raise."""
    from moetrace.engine.step_plan import build_plan

    model = gpu_model(torch.bfloat16)
    config = EngineConfig(
        num_kv_blocks=64, block_size=16, max_num_seqs=8, capture_weights="float16"
    )
    eng = LLMEngine(model, config, CUDA)
    for i in range(4):
        eng.add_request(f"r{i}", list(range(10 + i, 40 + i)), SamplingParams(max_tokens=4))
    plan = build_plan(eng.scheduler.schedule(), 16)
    graphs = eng.runner.graphs
    size = graphs.bucket(plan.num_tokens)
    meta = graphs._stage(plan, size)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            graphs._forward(size, meta)
        lists = eng.runner.transfer.start(
            eng.runner.capturer.tensors(plan.num_tokens), plan.slots, plan.slots * 0
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lists.wait()
    assert lists.weights is not None and lists.weights.dtype == np.float16
    assert (lists.weights > 0).all()


def test_ring_and_async_scheduling_keep_weights_with_their_ids():
    model = gpu_model(torch.bfloat16)
    prompts = shared_prefix_prompts(seed=12, count=16)
    a = run(model, prompts, capture_ring_size=1, max_num_seqs=16, capture_weights="float16")
    b = run(
        model,
        prompts,
        capture_ring_size=4,
        max_num_seqs=16,
        async_scheduling=False,
        num_kv_blocks=8,
        capture_weights="float16",
    )
    for rid in prompts:
        np.testing.assert_array_equal(a[rid].routed_experts, b[rid].routed_experts)
        np.testing.assert_array_equal(a[rid].routed_weights, b[rid].routed_weights)
