"""Weight updates and memory release on CUDA: graphs replay the new weights, memory comes back.

Skipped without a CUDA device (the lead runs them on the H200; the NCCL one
needs two GPUs). The reference is always an engine loaded fresh from the new
checkpoint on the same device, with its own graphs: after an update in place
the served engine must give its tokens and routed experts, row for row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.checkpoints import assert_same_routing
from support.gpt_oss import mxfp4_twins
from support.hf_reference import make_tiny_checkpoint, perturb_routers

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.memory_release import TAGS, MemoryRelease
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.weight_update import TensorSpec, WeightUpdater
from moetrace.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
PROMPTS = {f"p{i}": list(range(3 + i, 40 + 7 * i)) for i in range(6)}


def cuda_engine(path, **overrides) -> LLMEngine:
    loaded = load_model(str(path), device=CUDA, dtype="bfloat16")
    config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **overrides})
    return LLMEngine(loaded.model, config, CUDA)


def run(engine: LLMEngine, tag: str = "") -> dict:
    for i, (rid, ids) in enumerate(PROMPTS.items()):
        engine.add_request(tag + rid, ids, SamplingParams(max_tokens=12), index=i)
    return {f.request_id.removeprefix(tag): f for f in engine.run()}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    a = make_tiny_checkpoint("qwen3_moe", root / "a", seed=3, dtype=torch.bfloat16)
    return a, perturb_routers(a, root / "b", scale=3.0, seed=1)


def test_graphs_replay_new_weights_copied_in_place(qwen3):
    a, b = qwen3
    engine = cuda_engine(a)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.graphs, "the step graphs were captured at start"
    before = run(engine)
    updater = WeightUpdater(engine.model)
    updater.check_checkpoint(b)
    assert updater.load_checkpoint(b, CUDA) is False
    engine.reset_prefix_cache()
    after = run(engine, "after-")
    assert engine.runner.graphs is graphs  # replayed as captured, over the copied weights
    assert_same_routing(after, run(cuda_engine(b)))
    assert any(
        not np.array_equal(before[r].routed_experts, after[r].routed_experts) for r in PROMPTS
    )


def test_mxfp4_experts_are_relaid_and_wide_scales_recapture(tmp_path):
    _, quant = mxfp4_twins(tmp_path / "m")
    tensors = load_file(str(quant / "model.safetensors"))
    new = tmp_path / "new"
    new.mkdir()
    for name in list(tensors):
        if name.endswith("_blocks"):
            tensors[name] = tensors[name] ^ 0x11
        if name.endswith("_scales"):
            tensors[name] = tensors[name].clone()
            tensors[name][0, 0, 0] = 131  # past the fast decoder's 128: another kernel
    save_file(tensors, str(new / "model.safetensors"))
    (new / "config.json").write_text((quant / "config.json").read_text())
    engine = cuda_engine(quant)
    graphs = engine.runner.graphs
    updater = WeightUpdater(engine.model)
    updater.check_checkpoint(new)
    assert updater.load_checkpoint(new, CUDA) is True
    engine.runner.recapture()
    engine.reset_prefix_cache()
    assert engine.runner.graphs is not graphs
    assert_same_routing(run(engine), run(cuda_engine(new)))


def test_cuda_ipc_tensors_from_a_process_on_the_same_gpu(qwen3):
    from support.tensor_sender import TensorSender

    from moetrace.engine.tensor_ipc import named_tensors

    a, b = qwen3
    names = sorted(load_file(str(b / "model.safetensors")))
    engine = cuda_engine(a)
    sender = TensorSender(b, names, device="cuda")
    named: list = []
    try:
        named = named_tensors([sender.payload])
        assert all(t.is_cuda for _, t in named)
        updater = WeightUpdater(engine.model)
        updater.check([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named])
        updater.load(named)
        torch.cuda.synchronize()
    finally:
        named.clear()  # the trainer's memory: let go before it exits
        assert sender.close() == 0
    engine.reset_prefix_cache()
    assert_same_routing(run(engine), run(cuda_engine(b)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_broadcast_from_a_trainer_on_another_gpu(qwen3):
    from support.trainer import Trainer, specs_of

    from moetrace.distributed.update_group import UpdateGroup

    a, b = qwen3
    tensors = load_file(str(b / "model.safetensors"))
    specs = specs_of(tensors)
    engine = cuda_engine(a)
    trainer = Trainer(b, backend="nccl", device="cuda:1")
    try:
        group = UpdateGroup.join(
            master_address="127.0.0.1", master_port=trainer.port, rank=1, world_size=2,
            group_name=trainer.group, backend="nccl", timeout_s=120,
        )  # fmt: skip
        trainer.expect("joined")
        import threading

        received: list = []
        shapes = [(tuple(s[2]), getattr(torch, s[1])) for s in specs]
        thread = threading.Thread(target=lambda: received.extend(group.receive(shapes, CUDA)))
        thread.start()
        trainer.send(specs)
        thread.join(120)
        WeightUpdater(engine.model).load(zip([s[0] for s in specs], received, strict=True))
        group.leave()
    finally:
        assert trainer.close() == 0
    engine.reset_prefix_cache()
    assert_same_routing(run(engine), run(cuda_engine(b)))


def test_released_memory_returns_to_the_device_and_comes_back_the_same(qwen3):
    a, _ = qwen3
    engine = cuda_engine(a, num_kv_blocks=8192)
    before = run(engine)
    params = sum(p.numel() * p.element_size() for p in dict.fromkeys(engine.model.parameters()))
    cache = sum(t.numel() * t.element_size() for caches in engine.runner.kv_caches for t in caches)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    memory = MemoryRelease(engine)
    memory.release(TAGS)
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after - free_before >= 0.9 * (params + cache), (
        free_after - free_before,
        params,
        cache,
    )
    memory.resume(TAGS)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # captured again
    assert_same_routing(run(engine, "again-"), before)
