"""The engine on CUDA: kernels, graphs and capture against the plain path and transformers.

Skipped without a CUDA device.  Batch sizes are chosen equal to captured
graph sizes where eager and graph runs are compared, so both run the same
kernels on the same shapes and must agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import assert_forward_never_syncs, shared_prefix_prompts
from support.gpu_engine import CUDA, gpu_model, mixed_workload, run, run_counting

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def assert_same(a, b):
    assert set(a) == set(b)
    for rid in a:
        np.testing.assert_array_equal(a[rid].output_token_ids, b[rid].output_token_ids, err_msg=rid)
        np.testing.assert_array_equal(a[rid].routed_experts, b[rid].routed_experts, err_msg=rid)


def test_invariance_on_cuda_float64():
    model = gpu_model(torch.float64)
    prompts = shared_prefix_prompts(seed=5, count=12)
    base = run(model, prompts, use_kernels=False, enable_prefix_caching=False, max_num_seqs=1)
    for settings in (
        dict(use_kernels=False, num_kv_blocks=10, block_size=4, max_num_seqs=8),
        dict(use_kernels=False, max_num_batched_tokens=7, enable_prefix_caching=True),
    ):
        assert_same(base, run(model, prompts, **settings))


def test_kernels_match_the_plain_path_in_float32():
    model = gpu_model(torch.float32)
    prompts = shared_prefix_prompts(seed=6, count=16)
    plain = run(model, prompts, use_kernels=False, max_num_seqs=16)
    fast = run(model, prompts, use_kernels=True, enforce_eager=True, max_num_seqs=16)
    rows_plain = np.concatenate([plain[r].routed_experts for r in prompts])
    rows_fast = np.concatenate([fast[r].routed_experts for r in prompts])
    # Different kernels round differently: near-ties may flip, but almost never.
    assert (rows_plain == rows_fast).all(axis=(1, 2)).mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_replay_equals_eager(dtype):
    model = gpu_model(dtype)
    prompts = {f"p{i}": list(range(3 + i, 40 + 2 * i)) for i in range(16)}  # 16: a graph size
    eager = run(model, prompts, enforce_eager=True, max_num_seqs=16)
    graph = run(model, prompts, enforce_eager=False, max_num_seqs=16)
    assert_same(eager, graph)


@pytest.mark.parametrize(
    "setting",
    [
        dict(),  # prefix hits, chunked prefill beside decodes
        dict(num_kv_blocks=14),  # KV pressure: recompute preemption
        dict(abort=True),
        dict(async_scheduling=False),
    ],
    ids=["prefix-hits", "preemption", "abort", "sync"],
)
def test_mixed_steps_replayed_from_graphs_equal_eager(setting):
    """Steps mixing prefill chunks and decodes replay graphs, and record what eager records."""
    model = gpu_model(torch.bfloat16)
    prompts, max_tokens = mixed_workload(seed=21, count=24)
    setting = dict(setting)
    abort = (6, {"r1", "r5", "r9"}) if setting.pop("abort", False) else None
    engine = dict(max_num_seqs=8, max_num_batched_tokens=64, **setting)
    eager, eager_kinds, eager_stats = run_counting(
        model, prompts, max_tokens, abort, enforce_eager=True, **engine
    )
    graph, kinds, stats = run_counting(model, prompts, max_tokens, abort, **engine)
    assert_same(eager, graph)
    assert kinds.get("mixed/graph", 0) >= 5 and "mixed/eager" not in kinds, kinds
    assert kinds.get("decode-only graph", 0) >= 3, kinds
    assert "mixed/graph" not in eager_kinds
    if "num_kv_blocks" in setting:
        assert stats.preemptions > 0 and eager_stats.preemptions == stats.preemptions
    if abort:
        assert "abort" in {graph[r].finish_reason for r in abort[1]}
    assert any(f.num_cached_tokens for f in graph.values())  # prefix hits happened


def test_decode_only_graphs_give_the_mixed_graphs_logits():
    """A decode step padded with one-token sequences and replayed from its decode-only graph
    (no prefill-class attention launch) gives its real rows the logits that the mixed graph
    gives them padded with one long sequence, bit for bit."""
    from moetrace.engine.step_plan import build_plan

    model = gpu_model(torch.bfloat16)
    config = EngineConfig(num_kv_blocks=512, block_size=16, max_num_seqs=16, async_scheduling=False)
    eng = LLMEngine(model, config, CUDA)
    for i in range(5):
        eng.add_request(f"r{i}", list(range(3 + i, 30 + 3 * i)), SamplingParams(max_tokens=8))
    eng.step()
    eng.step()
    plan = build_plan(eng.scheduler.schedule(), config.block_size)
    assert plan.decode_only and plan.num_tokens == 5 and (plan.input_ids >= 0).all()
    graphs = eng.runner.graphs
    size = graphs.bucket(plan.num_tokens)
    assert size == 8 and graphs.pads_per_token(plan, size) and size in graphs.decode_graphs
    decode = graphs.run(plan, None).clone()
    graphs.pads_per_token = lambda plan, size: False  # pad as the mixed graphs do
    assert graphs.stage_graph(plan, size) is graphs.graphs[size]
    mixed = graphs.run(plan, None).clone()
    assert decode.shape[0] == 5
    torch.testing.assert_close(decode, mixed, rtol=0, atol=0)


def test_no_kernel_compiles_after_start_up():
    """Every step size is padded to a ladder the start-up compiled: no Triton compile mid-run."""
    import triton

    compiled: list[str] = []

    def hook(*args, **kwargs):
        compiled.append(str(kwargs.get("fn", "?")))
        return False

    model = gpu_model(torch.bfloat16)
    prompts, max_tokens = mixed_workload(seed=22, count=30)
    # Graphs up to 16 tokens; the 32- to 96-token sizes run eagerly, warmed up at start.
    config = dict(max_num_seqs=12, max_num_batched_tokens=96, max_cudagraph_capture_size=16)
    eng = LLMEngine(model, EngineConfig(num_kv_blocks=512, **config), CUDA)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens[rid]), index=i)
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        done = list(eng.run())
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert len(done) == len(prompts)
    assert compiled == [], f"compiled during the run: {compiled}"


def test_async_scheduling_equals_sync():
    model = gpu_model(torch.bfloat16)
    prompts = shared_prefix_prompts(seed=9, count=16)
    sync = run(model, prompts, async_scheduling=False, max_num_seqs=16)
    overlapped = run(model, prompts, async_scheduling=True, max_num_seqs=16)
    assert_same(sync, overlapped)
    pressured = run(model, prompts, async_scheduling=True, max_num_seqs=16, num_kv_blocks=6)
    assert set(pressured) == set(prompts)


def test_capture_ring_size_does_not_change_the_trace():
    model = gpu_model(torch.bfloat16)
    prompts = shared_prefix_prompts(seed=8, count=16)
    ring1 = run(model, prompts, capture_ring_size=1, max_num_seqs=16)
    ring4 = run(model, prompts, capture_ring_size=4, max_num_seqs=16)
    assert_same(ring1, ring4)


def test_bf16_routing_equals_transformers_router_teacher_forced(tmp_path):
    """Each layer's ids equal what transformers' own router picks from the same hidden states."""
    from support.hf_reference import make_tiny_checkpoint

    from moetrace.models.loader import load_model

    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=3, dtype=torch.bfloat16)
    ours = load_model(str(ckpt), device=CUDA, dtype="bfloat16").model
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(CUDA).eval()
    inputs: dict[int, torch.Tensor] = {}
    prompts = {"a": list(range(5, 60)), "b": list(range(100, 130))}
    done = run(ours, prompts, max_num_seqs=1, enforce_eager=True)
    # The last step's MoE inputs are a decode token of request b: compare per layer there,
    # and over a full teacher-forced prefill of request a.
    eng = LLMEngine(ours, EngineConfig(num_kv_blocks=64, enforce_eager=True), CUDA)
    seq = prompts["a"] + done["a"].output_token_ids.tolist()[:-1]
    eng.add_request(
        "a", prompts["a"] + done["a"].output_token_ids.tolist()[:-1], SamplingParams(max_tokens=1)
    )
    inputs.clear()
    # Steps on the kernels run at padded sizes: the real tokens come first.
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args, i=block.moe_index: inputs.__setitem__(i, args[0][: len(seq)])
        )
        for block in ours.moe_blocks()
    ]
    (teacher,) = list(eng.run())
    for h in hooks:
        h.remove()
    layers = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")]
    assert len(layers) == len(inputs)
    for moe_index, layer in enumerate(layers):
        with torch.inference_mode():  # our captured inputs are inference tensors
            _, _, ref_ids = ref.model.layers[layer].mlp.gate(inputs[moe_index])
        np.testing.assert_array_equal(
            ref_ids.cpu().numpy(),
            teacher.routed_experts[: len(seq), moe_index],
            err_msg=f"layer {layer}",
        )


def test_forward_and_capture_never_sync_the_host():
    """The model forward and the routing copy run with torch's sync checker set to raise."""
    assert_forward_never_syncs(gpu_model(torch.bfloat16), CUDA)
