"""Parity of moetrace's recorded routing with transformers, shared by every family's tests.

A tiny random checkpoint is written by transformers' own ``save_pretrained``;
moetrace records prompts through it; transformers' router modules, hooked on
the same token sequence, give the reference ids.  Both in float32 on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import load_model
from support.hf_reference import make_tiny_checkpoint, reference_greedy, reference_routing

CPU = torch.device("cpu")


def record(
    checkpoint: Path,
    prompts: dict[str, list[int]],
    max_tokens: int,
    *,
    device: torch.device = CPU,
    **engine,
) -> dict:
    """float32 run of every prompt: the model, finished requests by id, and the engine."""
    loaded = load_model(str(checkpoint), device=device, dtype="float32")
    defaults = {"num_kv_blocks": 128, "block_size": 4, "capture_weights": "float32"}
    config = EngineConfig(**{**defaults, **engine})
    eng = LLMEngine(loaded.model, config, device)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), index=i)
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return {"model": loaded.model, "done": done, "engine": eng}


def assert_mla_cuda_records_what_the_cpu_records(
    checkpoint: Path, prompts: dict[str, list[int]], device: torch.device
) -> None:
    """float32 on ``device``: MLA on its Triton kernels (both forms), experts on the plain path
    (the fused-MoE kernel is for 16-bit weights), so no CUDA graphs.

    Rows computed from identical tokens must match the CPU's, up to the rare
    near-tie a different rounding flips: over 95% of them.
    """
    engine = dict(max_num_batched_tokens=8, max_num_seqs=3)
    cpu = record(checkpoint, prompts, 5, **engine)["done"]
    other = record(checkpoint, prompts, 5, device=device, **engine)
    assert other["engine"].runner.graphs is None
    assert np.mean(rows_equal_while_tokens_agree(other["done"], cpu)) > 0.95


def rows_equal_while_tokens_agree(got: dict, want: dict) -> list[bool]:
    """Per comparable row of each request: are its ids equal?

    Rows computed from identical tokens are comparable: the prompt's and those
    of output tokens up to the first one the two runs sampled differently.
    """
    equal: list[bool] = []
    for rid, done in got.items():
        expected = want[rid]
        same = 0
        for a, b in zip(done.output_token_ids, expected.output_token_ids, strict=True):
            if a != b:
                break
            same += 1
        n = min(len(done.prompt_token_ids) + same, len(done.routed_experts))
        equal += (done.routed_experts[:n] == expected.routed_experts[:n]).all(axis=(1, 2)).tolist()
    return equal


def assert_parity(
    checkpoint: Path, prompts: dict[str, list[int]], max_tokens: int = 6, **engine
) -> None:
    """Recorded ids equal the reference routers' ids token by token; greedy tokens match."""
    got = record(checkpoint, prompts, max_tokens, **engine)
    model, done = got["model"], got["done"]
    for rid, prompt in prompts.items():
        finished = done[rid]
        expected_tokens = reference_greedy(checkpoint, prompt, max_tokens)
        assert finished.output_token_ids.tolist() == expected_tokens, f"{rid}: greedy tokens differ"
        sequence = prompt + finished.output_token_ids.tolist()[:-1]
        ref = reference_routing(checkpoint, sequence)
        assert ref["moe_layer_indices"] == model.moe_layer_indices
        assert finished.routed_experts.shape == ref["topk_ids"].shape
        mismatch = np.argwhere(finished.routed_experts != ref["topk_ids"])
        assert mismatch.size == 0, (
            f"{rid}: first mismatch (token, layer, rank) {mismatch[0].tolist()}"
        )
        assert_weights_match(finished.routed_weights, ref["topk_weights"], rid)


# How far a recorded gate weight may be from transformers' router output, by stored dtype.
# float32: both compute the weights in float32 with the same ops, but from hidden states
# that reach the router through different code (attention, norms), some float32 ulps
# apart by then, which the softmax carries into the weights: over every family and shape
# here, at most 7.4e-6 relative; 5e-5 leaves room without hiding a wrong formula (a missed
# renormalisation or scaling factor is off by far more).
# float16: that, plus the one rounding to float16 (half an ulp: 2**-11 relative, and
# 2**-25 absolute among float16's subnormals, below 2**-14).
WEIGHT_TOLERANCE = {
    "float32": dict(rtol=5e-5, atol=1e-6),
    "float16": dict(rtol=2**-11 + 5e-5, atol=2**-25 + 1e-6),
}


def assert_weights_match(got: np.ndarray | None, want: np.ndarray, rid: str) -> None:
    assert got is not None, f"{rid}: no gate weights recorded"
    assert got.shape == want.shape, f"{rid}: weights {got.shape} vs {want.shape}"
    np.testing.assert_allclose(
        got.astype(np.float64), want, **WEIGHT_TOLERANCE[got.dtype.name], err_msg=rid
    )


def prompts(seed: int, *, short: bool = True, long: int = 23) -> dict[str, list[int]]:
    """Seeded prompts: a short one, a long one, two sharing a 9-token prefix (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 300, 9).tolist()
    out = {"short": rng.integers(0, 300, 3).tolist()} if short else {}
    out["long"] = rng.integers(0, 300, long).tolist()
    out["shared-a"] = shared + rng.integers(0, 300, 4).tolist()
    out["shared-b"] = shared + rng.integers(0, 300, 6).tolist()
    return out


def assert_shape_parity(
    family: str,
    tmp_path: Path,
    name: str,
    overrides: dict,
    *,
    prompt_set: dict[str, list[int]] | None = None,
    **engine,
) -> None:
    """Parity of one named config shape of ``family``, seeded by the shape's name."""
    ckpt = make_tiny_checkpoint(family, tmp_path / name, seed=len(name), **overrides)
    # Small steps and blocks: chunked prefill, prefix hits and decode all take part.
    chosen = prompts(len(name)) if prompt_set is None else prompt_set
    assert_parity(ckpt, chosen, **{"max_num_batched_tokens": 8, "max_num_seqs": 3, **engine})


def record_dummy_trace(
    checkpoint: Path,
    tmp_path: Path,
    lines: list[dict],
    *,
    max_tokens: int = 2,
    dtype: str = "auto",
    **options,
) -> Path:
    """Record ``lines`` through the real recording path on dummy weights; returns the trace."""
    import json

    from moetrace.runs.recording import Recording, SamplingDefaults
    from moetrace.runs.setup import RunOptions

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "t.h5"
    Recording(
        RunOptions.of(
            str(checkpoint),
            engine=EngineConfig(num_kv_blocks=16, block_size=4),
            device="cpu",
            dtype=dtype,
            load_format="dummy",
        ),
        str(prompts),
        out,
        sampling=SamplingDefaults(max_tokens=max_tokens),
        **options,
    ).run()
    return out
