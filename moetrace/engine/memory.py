"""Sizing the KV cache: what is left of the memory budget after weights and activations.

On CUDA a profiling forward at the largest step (``max_num_batched_tokens``
tokens) measures peak activation memory; the cache gets
``total * gpu_memory_utilization - weights - peak activations - graph reserve``.
On the CPU the budget is a fixed size (``cpu_kv_cache_gib``).
"""

from __future__ import annotations

import math

import torch

from moetrace.config import EngineConfig
from moetrace.distributed.state import get_parallel_state
from moetrace.forward_context import AttentionMetadata, forward_context
from moetrace.models.base import MoEForCausalLM

GRAPH_RESERVE_BYTES = 512 << 20  # CUDA graphs' own pool beyond their share of the peak


def kv_bytes_per_block(model: MoEForCausalLM, block_size: int) -> int:
    dtype = next(model.parameters()).dtype
    item = torch.empty(0, dtype=dtype).element_size()
    shapes = (s for layer in model.attention_layers() for s in layer.kv_cache_shapes(1, block_size))
    return sum(math.prod(shape) for shape in shapes) * item


@torch.inference_mode()
def profile_peak_activation_bytes(
    model: MoEForCausalLM, config: EngineConfig, device: torch.device, max_model_len: int
) -> int:
    """Peak memory of one forward over ``max_num_batched_tokens`` tokens, beyond the weights."""
    bs = config.block_size
    tokens = config.max_num_batched_tokens
    seq_len = min(tokens, max_model_len)
    num_seqs = -(-tokens // seq_len)
    blocks_per_seq = -(-seq_len // bs)
    num_blocks = num_seqs * blocks_per_seq
    dtype = next(model.parameters()).dtype
    layers = list(model.attention_layers())
    for layer in layers:
        shapes = layer.kv_cache_shapes(num_blocks, bs)
        layer.bind_kv_cache([torch.zeros(s, dtype=dtype, device=device) for s in shapes])
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(
        num_seqs, blocks_per_seq
    )
    slots = torch.cat(
        [b * blocks_per_seq * bs + torch.arange(n, device=device) for b, n in enumerate(lens)]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        block_size=bs,
        query_start_loc_host=starts,
        seq_lens_host=lens,
        min_query_len=min(lens),
    )
    ids = torch.randint(0, model.vocab_size, (tokens,), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with forward_context(meta):
        hidden = model(ids, positions)
        model.compute_logits(hidden[-min(tokens, config.max_num_seqs) :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    for layer in layers:
        layer.bind_kv_cache([torch.empty(0) for _ in layer.kv_cache_shapes(0, bs)])
    torch.cuda.empty_cache()
    return peak


def plan_num_blocks(
    model: MoEForCausalLM, config: EngineConfig, device: torch.device, max_model_len: int
) -> int:
    per_block = kv_bytes_per_block(model, config.block_size)
    enough_for_all = config.max_num_seqs * -(-max_model_len // config.block_size)
    if device.type != "cuda":
        budget = int(config.cpu_kv_cache_gib * (1 << 30))
        return _agree(max(1, min(enough_for_all, budget // per_block)))
    peak = profile_peak_activation_bytes(model, config, device, max_model_len)
    _free, total = torch.cuda.mem_get_info(device)
    in_use = torch.cuda.memory_allocated(device)
    # The graphs' pool holds the activations of the largest captured step, about
    # its share of the profiled peak (activations grow with the token count).
    graph_share = min(1.0, config.max_cudagraph_capture_size / config.max_num_batched_tokens)
    graphs = 0 if config.enforce_eager else int(peak * graph_share) + GRAPH_RESERVE_BYTES
    budget = int(total * config.gpu_memory_utilization) - in_use - peak - graphs
    budget -= decode_scratch_bytes(model)
    return _agree(max(1, min(enough_for_all, budget // per_block)))


def decode_scratch_bytes(model: MoEForCausalLM) -> int:
    """The largest scratch one attention call takes for a batch of decodes (the pool of
    sinks' scores: ``triton_attention.sink_scratch_bytes``), which the profiling forward,
    one long sequence, does not reach."""
    from moetrace.kernels.triton_attention import sink_scratch_bytes

    item = next(model.parameters()).element_size()
    return max(
        (
            sink_scratch_bytes(layer.num_heads, item)
            for layer in model.attention_layers()
            if layer.sinks is not None
        ),
        default=0,
    )


def _agree(num_blocks: int) -> int:
    """Tensor-parallel ranks share block ids, so they keep as many blocks as the fullest device."""
    state = get_parallel_state()
    return num_blocks if state is None else state.comm.min_int(num_blocks)
