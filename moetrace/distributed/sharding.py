"""Build a family's model with only this rank's slice of the weights.

The family builds its single-device model with every parameter on the
``meta`` device (no memory; buffers such as rotary frequencies stay real),
then each shardable module is cut down in place and only then are the
parameters allocated on the device.  Parameter names never change, so the
family's ``WeightMap`` still names them; each of its targets is rewritten to
say which slice of the checkpoint tensor this rank keeps (``Target.narrow``)
and where it lands.

What is split (column = output features, row = input features):

=====================  ==========================================  ===============
parameter              tensor parallel                             expert parallel
=====================  ==========================================  ===============
attention q / k / v    column, by head (k/v replicated when fewer  same
                       kv heads than ranks)
attention ``o_proj``   row, + all-reduce                           same
dense MLP gate/up/down column / column / row, + all-reduce         same
experts ``w13``/``w2`` each expert's intermediate dim, all experts whole experts, 1/N
router, norms,         replicated                                  replicated
embeddings, lm_head
=====================  ==========================================  ===============
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from moetrace.distributed.layers import (
    RowParallelLinear,
    all_reduce_hook,
    expert_parallel_hook,
    sequence_parallel_block_hooks,
    sequence_parallel_experts_hooks,
)
from moetrace.distributed.state import (
    Collectives,
    SequenceParallelContext,
    TensorParallelLayout,
    get_parallel_state,
)
from moetrace.errors import ModelError
from moetrace.layers.attention import PagedAttention
from moetrace.layers.moe import MoEExperts
from moetrace.models.base import MoEBlockBase, MoEForCausalLM
from moetrace.models.loader import LoadedModel, instantiate, load_model
from moetrace.models.source import ModelSource
from moetrace.models.weights import Target, WeightMap


@dataclass(frozen=True)
class ParamShard:
    """Which parts of the full parameter this rank holds, all along one dimension.

    ``pieces`` are ``(dst_start, src_start, size)``: rows ``src_start ...`` of
    the full parameter land at ``dst_start ...`` of the local one (a fused
    q/k/v takes three pieces, a fused gate/up two).
    """

    full_shape: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(size for _, _, size in self.pieces)
        return tuple(shape)

    def copy_from_full(self, local: torch.Tensor, full: torch.Tensor) -> None:
        for dst, src, size in self.pieces:
            local.narrow(self.dim, dst, size).copy_(full.narrow(self.dim, src, size))


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first kv head, count) this rank keeps; one replicated head when heads < ranks."""
    if num_kv_heads % size == 0:
        count = num_kv_heads // size
        return rank * count, count
    # size % num_kv_heads == 0 (guarded): size // num_kv_heads ranks share each kv head,
    # and a rank's query heads all belong to that head's group.
    return rank // (size // num_kv_heads), 1


def split_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank's equal share of ``total`` (divisibility is guarded)."""
    count = total // size
    return rank * count, count


# ------------------------------------------------------------------ building
@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to ``meta``; buffers stay where built.

    A parameter is created on the real device first (``torch.empty``, not
    touched) and moved at once, so the transient cost is one parameter.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate every meta parameter on ``device`` (zeros; tied parameters stay tied)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                data = torch.zeros(param.shape, dtype=param.dtype, device=device)
                made[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]


def _resize(module: nn.Module, name: str, shape: tuple[int, ...]) -> nn.Parameter:
    old = getattr(module, name)
    new = nn.Parameter(
        torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad
    )
    setattr(module, name, new)
    return new


def _apply(
    module: nn.Module, prefix: str, name: str, shard: ParamShard, out: dict[str, ParamShard]
) -> None:
    _resize(module, name, shard.shape)
    out[f"{prefix}{name}"] = shard


# ------------------------------------------------------------- module plans
def is_attention(module: nn.Module) -> bool:
    return (
        isinstance(getattr(module, "attn", None), PagedAttention)
        and isinstance(getattr(module, "qkv", None), nn.Linear)
        and isinstance(getattr(module, "o_proj", None), nn.Linear)
    )


def is_dense_mlp(module: nn.Module) -> bool:
    params = module._parameters
    return isinstance(params.get("gate_up"), nn.Parameter) and isinstance(
        params.get("down"), nn.Parameter
    )


def _shard_attention(
    prefix: str, attn: nn.Module, layout: TensorParallelLayout, comm: Collectives
) -> dict[str, ParamShard]:
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_first, q_count = split_range(heads, layout.rank, layout.size)
    kv_first, kv_count = kv_heads_of(layout.rank, layout.size, kv_heads)
    q_rows, kv_rows = q_count * dim, kv_count * dim
    pieces = (
        (0, q_first * dim, q_rows),
        (q_rows, (heads + kv_first) * dim, kv_rows),
        (q_rows + kv_rows, (heads + kv_heads + kv_first) * dim, kv_rows),
    )
    shards: dict[str, ParamShard] = {}
    qkv = attn.qkv
    _apply(qkv, f"{prefix}qkv.", "weight", ParamShard(tuple(qkv.weight.shape), 0, pieces), shards)
    if qkv.bias is not None:
        _apply(qkv, f"{prefix}qkv.", "bias", ParamShard(tuple(qkv.bias.shape), 0, pieces), shards)
    qkv.out_features = q_rows + 2 * kv_rows
    o_proj = attn.o_proj
    o_shard = ParamShard(tuple(o_proj.weight.shape), 1, ((0, q_first * dim, q_rows),))
    _apply(o_proj, f"{prefix}o_proj.", "weight", o_shard, shards)
    attn.o_proj = RowParallelLinear(o_proj.weight, o_proj.bias, comm)
    attn.num_heads, attn.num_kv_heads = q_count, kv_count
    if hasattr(attn, "q_size"):
        attn.q_size, attn.kv_size = q_rows, kv_rows
    attn.attn.num_heads, attn.attn.num_kv_heads = q_count, kv_count
    return shards


def _shard_dense(prefix: str, mlp: nn.Module, layout: TensorParallelLayout) -> dict:
    inter = mlp.down.shape[1]
    first, count = split_range(inter, layout.rank, layout.size)
    gate_up = ParamShard(
        tuple(mlp.gate_up.shape), 0, ((0, first, count), (count, inter + first, count))
    )
    down = ParamShard(tuple(mlp.down.shape), 1, ((0, first, count),))
    shards: dict[str, ParamShard] = {}
    _apply(mlp, prefix, "gate_up", gate_up, shards)
    _apply(mlp, prefix, "down", down, shards)
    return shards


def _shard_experts(prefix: str, experts: MoEExperts, layout: TensorParallelLayout) -> dict:
    if experts.b13 is not None or experts.b2 is not None:
        raise ModelError("experts with biases cannot be sharded yet")
    shards: dict[str, ParamShard] = {}
    w13, w2 = tuple(experts.w13.shape), tuple(experts.w2.shape)
    if layout.expert_parallel:
        first, count = split_range(experts.num_experts, layout.rank, layout.size)
        _apply(experts, prefix, "w13", ParamShard(w13, 0, ((0, first, count),)), shards)
        _apply(experts, prefix, "w2", ParamShard(w2, 0, ((0, first, count),)), shards)
        experts.num_experts = count
        experts.register_forward_pre_hook(expert_parallel_hook(first, count))
        return shards
    inter = experts.intermediate
    first, count = split_range(inter, layout.rank, layout.size)
    gate_up = ((0, first, count), (count, inter + first, count))
    _apply(experts, prefix, "w13", ParamShard(w13, 1, gate_up), shards)
    _apply(experts, prefix, "w2", ParamShard(w2, 2, ((0, first, count),)), shards)
    experts.intermediate = count
    return shards


def shard_model(
    model: MoEForCausalLM,
    layout: TensorParallelLayout,
    comm: Collectives,
    sp_context: SequenceParallelContext | None = None,
) -> dict[str, ParamShard]:
    """Cut a meta-parameter model down to this rank's slice and add its communication.

    Returns the shards by parameter name (also kept as ``model.param_shards``
    for the dummy-weight fill); ``shard_weight_map`` then rewrites the
    family's weight map for them, once the parameters are allocated.
    """
    shards: dict[str, ParamShard] = {}
    sp_context = sp_context or SequenceParallelContext()  # shared with the capturer when given
    modules = list(model.named_modules())
    blocks = [name for name, m in modules if isinstance(m, MoEBlockBase)]

    def inside_block(name: str) -> bool:
        return any(name.startswith(f"{b}.") for b in blocks)

    for name, module in modules:
        prefix = f"{name}." if name else ""
        if is_attention(module):
            shards.update(_shard_attention(prefix, module, layout, comm))
        elif isinstance(module, MoEExperts):
            shards.update(_shard_experts(prefix, module, layout))
            if layout.sequence_parallel:
                pre, post = sequence_parallel_experts_hooks(comm, sp_context)
                module.register_forward_pre_hook(pre, prepend=True)  # before the EP remap
                module.register_forward_hook(post)
        elif is_dense_mlp(module):
            if inside_block(name) and layout.sequence_parallel:
                # Its partial output would need the block's sum, which the chunked block skips.
                raise ModelError("sequence-parallel MoE does not support shared experts")
            shards.update(_shard_dense(prefix, module, layout))
            if not inside_block(name):
                module.register_forward_hook(all_reduce_hook(comm))
        elif isinstance(module, MoEBlockBase):
            if layout.sequence_parallel:
                pre, post = sequence_parallel_block_hooks(comm, sp_context)
                module.register_forward_pre_hook(pre)
                module.register_forward_hook(post)
            else:
                module.register_forward_hook(all_reduce_hook(comm))
    model.param_shards = shards
    return shards


# ------------------------------------------------------------- weight maps
def shard_target(target: Target, shard: ParamShard, name: str) -> Target | None:
    """Rewrite one checkpoint tensor's target for a sharded parameter; None if not this rank's.

    The checkpoint tensor covers, in the full parameter, expert ``index`` (dim
    0) if given and rows ``[row_start, row_start + row_count)`` of the next
    dim if given; its own dims are the full parameter's after the index dim.
    """
    offset = 0 if target.index is None else 1
    if shard.dim == 0 and target.index is not None:  # whole experts
        for dst, src, size in shard.pieces:
            if src <= target.index < src + size:
                return replace(target, index=dst + target.index - src)
        return None
    full = shard.full_shape[shard.dim]
    if shard.dim == offset and target.row_start is not None:  # a fused row block
        lo, hi = target.row_start, target.row_start + target.row_count
        hits = [(d, s, n) for d, s, n in shard.pieces if s < hi and lo < s + n]
        if not hits:
            return None
        if len(hits) > 1:
            raise ModelError(f"checkpoint tensor {name!r} spans several shards of one rank")
        dst, src, size = hits[0]
        a, b = max(lo, src), min(hi, src + size)
        return replace(
            target,
            row_start=dst + a - src,
            row_count=b - a,
            narrow=(0, a - lo, b - a, target.row_count),
        )
    if len(shard.pieces) != 1 or shard.pieces[0][0] != 0:
        raise ModelError(f"checkpoint tensor {name!r} cannot be split for tensor parallelism")
    _, src, size = shard.pieces[0]
    return replace(target, narrow=(shard.dim - offset, src, size, full))


def shard_weight_map(
    model: nn.Module, weights: WeightMap, shards: dict[str, ParamShard]
) -> WeightMap:
    sharded = WeightMap(model)  # picks up the resized parameters
    for name, target in weights.targets.items():
        shard = shards.get(target.param)
        new = target if shard is None else shard_target(target, shard, name)
        if new is not None:
            sharded.targets[name] = new
    return sharded


def instantiate_sharded(
    config: dict,
    source: str,
    dtype: torch.dtype,
    device: torch.device,
    layout: TensorParallelLayout,
    comm: Collectives,
    sp_context: SequenceParallelContext | None = None,
) -> MoEForCausalLM:
    """The family's model for this rank: built on meta, cut down, then allocated."""
    with parameters_on_meta():
        model = instantiate(config, source, dtype, device)
    shards = shard_model(model, layout, comm, sp_context)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the full-size parameters existed for a moment each
    materialize(model, device)
    model.weights = shard_weight_map(model, model.weights, shards)  # the allocated parameters
    return model


def load_model_for_rank(source: ModelSource, **options) -> LoadedModel:
    """``load_model`` for this process: under tensor parallelism only its slice of each weight.

    ``options`` are ``load_model``'s; on one device this is ``load_model`` itself.
    """
    state = get_parallel_state()
    if state is None:
        return load_model(source, **options)

    def build(config: dict, where: str, dtype: torch.dtype, device: torch.device):
        return instantiate_sharded(config, where, dtype, device, state.layout, state.comm, state.sp)

    return load_model(source, build=build, **options)
