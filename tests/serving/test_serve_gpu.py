"""``moetrace serve`` on CUDA returns what ``moetrace record`` writes on CUDA (demo, greedy)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from support.serve import DEMO_MOE_LAYERS, ServerProcess, record_demo, vllm_decode

pytestmark = pytest.mark.gpu

PROMPTS = [f"{i}: the experts route this token" for i in range(16)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["--engine-in-process", "--engine-process"])
def test_cuda_server_returns_what_cuda_record_writes(tmp_path, layout):
    lines = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    recorded = record_demo(tmp_path, lines, max_tokens=16, device="cuda")
    srv = ServerProcess("demo", "--device", "cuda", "--enable-return-routed-experts", layout)
    try:
        for i, prompt in enumerate(PROMPTS):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
            choice = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()[
                "choices"
            ][0]
            want = recorded[str(i)]
            assert choice["token_ids"] == want["output"]
            rows = vllm_decode(choice["routed_experts"])
            np.testing.assert_array_equal(rows[:, DEMO_MOE_LAYERS], want["rows"])
    finally:
        assert srv.stop() == 0, srv.stderr
