"""Sampling features on CUDA: the same choices as on the CPU, and no host sync.

Skipped without a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import shared_prefix_prompts
from support.gpu_engine import CUDA, gpu_model

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.request import Request
from moetrace.engine.sampler import sample, token_logprobs
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.sampling_inputs import SamplingInputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FEATURES = dict(
    temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, repetition_penalty=1.2,
    frequency_penalty=0.5, presence_penalty=0.3, min_tokens=3, logprobs=4,
)  # fmt: skip


def sampling_requests(vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    requests = []
    for i in range(6):
        params = SamplingParams(**{**FEATURES, "seed": i}) if i % 2 else SamplingParams()
        r = Request(f"r{i}", rng.integers(0, vocab, 20).tolist(), params, index=i,
                    eos_token_ids=(1,))  # fmt: skip
        r.num_placeholders = 1  # scheduled to sample its first token
        requests.append(r)
    return requests


def test_cuda_chooses_what_the_cpu_chooses_without_a_host_sync():
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    chosen = {}
    for device in (torch.device("cpu"), CUDA):
        inputs = SamplingInputs(vocab, device, global_seed=0)
        requests = sampling_requests(vocab)
        steps = []
        for _ in range(3):  # counts carried between steps on the device
            batch = inputs.build(requests)
            on_device = logits.to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                ids = sample(on_device, batch)
                lp = token_logprobs(on_device, ids, batch.num_logprobs)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            steps.append((ids.cpu().tolist(), lp.top_ids.cpu().tolist()))
            for r, token in zip(requests, ids.cpu().tolist(), strict=True):
                r.num_placeholders = 0
                r.append_token(token)
                r.num_placeholders = 1
        chosen[device.type] = steps
    assert chosen["cpu"] == chosen["cuda"]


def run(model, prompts, **engine):
    config = EngineConfig(**{"num_kv_blocks": 512, "block_size": 16, **engine})
    eng = LLMEngine(model, config, CUDA)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, SamplingParams(max_tokens=12, **FEATURES), index=i)
    done = {f.request_id: f for f in eng.run()}
    eng.block_manager.check_no_leaks()
    return done


@pytest.mark.parametrize(
    "settings",
    [dict(enforce_eager=False), dict(async_scheduling=False), dict(max_num_seqs=1)],
)
def test_penalized_sampling_is_the_same_in_graphs_async_and_alone(settings):
    model = gpu_model(torch.float32)
    prompts = shared_prefix_prompts(seed=5, count=16)
    base = run(model, prompts, enforce_eager=True, async_scheduling=True, max_num_seqs=16)
    other = run(model, prompts, **{"enforce_eager": True, "max_num_seqs": 16, **settings})
    for rid in prompts:
        np.testing.assert_array_equal(base[rid].output_token_ids, other[rid].output_token_ids)
        np.testing.assert_array_equal(base[rid].logprobs.top_ids, other[rid].logprobs.top_ids)
