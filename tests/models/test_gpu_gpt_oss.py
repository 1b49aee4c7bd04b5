"""gpt-oss on CUDA: every module on the kernels, decode graphs, and agreement with transformers.

Skipped without a CUDA device.  Batch sizes equal captured graph sizes where
eager and graph runs are compared, so both run the same kernels on the same
shapes and must agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import assert_forward_never_syncs
from support.gpt_oss import mxfp4_twins
from support.gpt_oss_fidelity import (
    REAL_WIDTH,
    build_twins,
    differing_margins,
    layer_forced_rows,
    reference_pass,
    run_engine,
    set_agreement,
)
from support.hf_reference import make_tiny_checkpoint
from support.parity import record, rows_equal_while_tokens_agree

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.layers import moe
from moetrace.models.loader import fill_dummy, instantiate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def tiny_gpt_oss(weight_format: str) -> torch.nn.Module:
    """A random 4-layer gpt-oss in bf16 on CUDA; sinks and biases random (not dummy zeros)."""
    config = {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 128,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 4096,
    }
    if weight_format == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4"}
    model = instantiate(config, "tiny gpt-oss", torch.bfloat16, torch.device("cpu"))
    fill_dummy(model, 11, std=0.3)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias", "b13", "b2")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model.to(CUDA)


def run(model, prompts: dict[str, list[int]], **engine) -> tuple[dict, LLMEngine]:
    config = EngineConfig(**{"num_kv_blocks": 512, "block_size": 16, **engine})
    eng = LLMEngine(model, config, CUDA)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True), index=i)
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return done, eng


@pytest.mark.parametrize("weight_format", ["dense", "mxfp4", "mxfp4-checkpoint"])
def test_every_module_on_the_kernels_and_graphs_replay_eager_steps(weight_format, monkeypatch):
    """MXFP4 in the default fragment layout (``kernels/mxfp4_layout.py``) and, as
    ``MOETRACE_MXFP4_LAYOUT=checkpoint`` keeps it, the checkpoint's."""
    fmt, _, layout = weight_format.partition("-")
    if layout:
        monkeypatch.setattr(moe, "MXFP4_LAYOUT", layout)
    model = tiny_gpt_oss(fmt)
    if fmt == "mxfp4":
        layouts = {m.mxfp4_layout for m in model.modules() if isinstance(m, moe.MoEExperts)}
        assert layouts == {layout or "fragment"}
    # 16 prompts (a graph size) of 37-67 tokens: past the 16-token window; split-K decode.
    prompts = {f"p{i}": list(range(3 + i, 40 + 2 * i)) for i in range(16)}
    eager, _ = run(model, prompts, enforce_eager=True, max_num_seqs=16)
    graph, engine = run(model, prompts, enforce_eager=False, max_num_seqs=16)
    modules = [m for m in model.modules() if hasattr(m, "use_triton")]
    assert modules and all(m.use_triton for m in modules)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # captured
    assert set(eager) == set(graph)
    for rid in eager:
        np.testing.assert_array_equal(eager[rid].output_token_ids, graph[rid].output_token_ids)
        np.testing.assert_array_equal(eager[rid].routed_experts, graph[rid].routed_experts)


@pytest.mark.parametrize("weight_format", ["dense", "mxfp4"])
def test_fused_routing_records_what_the_torch_routing_records(weight_format, monkeypatch):
    """The router's top-k and softmax in the fused kernel (its pairs grouped in a table the
    expert GEMMs read) against the torch ops: the same tokens, ids and gate weights."""
    model = tiny_gpt_oss(weight_format)
    prompts = {f"p{i}": list(range(3 + i, 40 + 2 * i)) for i in range(16)}
    runs = {}
    for max_tokens in (0, moe.FUSED_ROUTING_MAX_TOKENS):
        monkeypatch.setattr(moe, "FUSED_ROUTING_MAX_TOKENS", max_tokens)
        runs[max_tokens], _ = run(model, prompts, enforce_eager=True, capture_weights="float32")
    torch_path, fused = runs.values()
    blocks = [m for m in model.modules() if isinstance(m, moe.MoEExperts)]
    assert all(b._grouping_work is not None for b in blocks)  # the fused kernel ran
    for rid in torch_path:
        want, got = torch_path[rid], fused[rid]
        np.testing.assert_array_equal(got.output_token_ids, want.output_token_ids)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
        np.testing.assert_array_equal(got.routed_weights, want.routed_weights)


def test_forward_and_capture_never_sync_the_host():
    """Sinks, MXFP4 experts and in-kernel capture with torch's sync checker set to raise."""
    assert_forward_never_syncs(tiny_gpt_oss("mxfp4"), CUDA)


@pytest.mark.parametrize("weight_format", ["dense", "mxfp4"])
def test_float32_cuda_records_what_the_cpu_records(tmp_path, weight_format):
    """float32: attention on the kernel (fp32 dots), experts and norms on the plain path."""
    if weight_format == "mxfp4":
        _, ckpt = mxfp4_twins(tmp_path)
    else:
        ckpt = make_tiny_checkpoint("gpt_oss", tmp_path / "dense", seed=5)
    prompts = {f"p{i}": list(range(5 + 3 * i, 30 + 5 * i)) for i in range(6)}
    engine = dict(max_num_batched_tokens=16, max_num_seqs=4)
    cpu = record(ckpt, prompts, 6, **engine)["done"]
    gpu = record(ckpt, prompts, 6, device=CUDA, **engine)
    assert any(m.use_triton for m in gpu["model"].modules() if hasattr(m, "use_triton"))
    equal = rows_equal_while_tokens_agree(gpu["done"], cpu)
    assert np.mean(equal) > 0.99, np.mean(equal)


@pytest.fixture(scope="module")
def twins():
    return build_twins(REAL_WIDTH, CUDA)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "plain"])
def test_bf16_layer_forced_routing_agrees_with_transformers(twins, use_kernels):
    """gpt-oss-20b widths in bf16: each of our layers fed the hidden states transformers'
    same layer received, so a layer's routing is compared without earlier layers' drift.

    Rows may differ only at near-ties of the router (gap between the k-th and
    (k+1)-th logit under 5% of the row's logit spread: a few bf16 steps), and rarely.  Given our
    own router inputs, transformers' router must pick exactly our ids.
    """
    rng = np.random.default_rng(1)
    sequence = rng.integers(0, REAL_WIDTH["vocab_size"], 512).tolist()
    ref = reference_pass(twins.reference, [sequence])
    rows, router_inputs = layer_forced_rows(
        twins.ours,
        sequence,
        ref["inputs"],
        CUDA,
        use_kernels=use_kernels,
        enforce_eager=True,
        max_num_batched_tokens=1024,
    )
    figures = []
    for i in range(REAL_WIDTH["num_hidden_layers"]):
        agree = set_agreement(rows[:, i], ref["ids"][i].cpu().numpy())
        gaps = differing_margins(rows[:, i], ref["ids"][i], ref["logits"][i])
        figures.append(f"layer {i}: {agree:.4f} (largest gap {gaps.max() if gaps.size else 0:.3f})")
        assert agree >= 0.99, figures
        assert (gaps < 0.05).all(), figures
        with torch.inference_mode():
            _, _, ref_ids = twins.reference.model.layers[i].mlp.router(router_inputs[i])
        np.testing.assert_array_equal(ref_ids.cpu().numpy(), rows[:, i], err_msg=f"layer {i}")
    print("layer-forced agreement with transformers,", "kernels" if use_kernels else "plain")
    print("\n".join(figures))


def test_bf16_free_running_agreement_with_transformers(twins):
    """Same tokens, each model its own hidden states: our kernels and decode graphs against
    transformers' default experts (grouped_mm) and its eager ones.

    The two transformers paths differ only in how they sum each token's k
    expert outputs, and that alone makes their routing part in later layers:
    their disagreement is the floor.  Ours may not exceed twice the floor plus
    three points in any layer.
    """
    rng = np.random.default_rng(2)
    prompts = rng.integers(0, REAL_WIDTH["vocab_size"], (8, 192)).tolist()
    done = run_engine(twins.ours, prompts, 32, CUDA, max_num_seqs=8)  # decode: batch-8 graph
    sequences = [p + d.output_token_ids.tolist()[:-1] for p, d in zip(prompts, done, strict=True)]
    ours = np.concatenate([d.routed_experts for d in done])  # [8 * 223, L, k]
    twins.reference.set_experts_implementation("grouped_mm")
    grouped = reference_pass(twins.reference, sequences)
    twins.reference.set_experts_implementation("eager")
    eager = reference_pass(twins.reference, sequences)
    twins.reference.set_experts_implementation("grouped_mm")
    figures = []
    for i in range(REAL_WIDTH["num_hidden_layers"]):
        want = grouped["ids"][i].cpu().numpy()
        agree = set_agreement(ours[:, i], want)
        floor = set_agreement(eager["ids"][i].cpu().numpy(), want)
        gaps = differing_margins(ours[:, i], grouped["ids"][i], grouped["logits"][i])
        figures.append(
            f"layer {i}: ours {agree:.4f}, transformers eager vs grouped_mm {floor:.4f}, "
            f"ours vs eager experts {set_agreement(ours[:, i], eager['ids'][i].cpu().numpy()):.4f}, "
            f"largest gap {gaps.max() if gaps.size else 0:.3f}"
        )
        assert 1 - agree <= 2 * (1 - floor) + 0.03, figures
    print("free-running agreement with transformers (kernels, decode graphs)")
    print("\n".join(figures))
