"""The communication a sharded model adds to the families' unchanged modules.

Families are written for one device; tensor parallelism is added after the
model is built, by swapping ``o_proj`` for a row-parallel linear and hooking
the MLPs, so no family module needs to know about ranks:

- attention: q/k/v heads column-split, ``o_proj`` row-split, all-reduce;
- dense MLP (and a whole MoE block): output all-reduced;
- expert parallel: ids of experts this rank lacks get weight 0 (see ``expert_parallel_hook``);
- sequence-parallel MoE: the block sees only its chunk of tokens, the
  experts see every token and hand back their chunk (gather in, reduce-scatter
  out), the block's output is gathered back to every rank.

The router's weights are never split, so every rank computes the same ids
(or, under sequence parallelism, the same ids for the rows it owns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrace.distributed.sequence_parallel import split_rows
from moetrace.distributed.state import Collectives, SequenceParallelContext


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over ranks.

    Each rank's product is partial; the all-reduce sums them and the bias,
    held whole by every rank, is added once after the sum.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: Collectives) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce_(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


Hook = Callable[..., object]


def all_reduce_hook(comm: Collectives) -> Hook:
    """Forward hook: sum a module's partial output over the ranks, in place."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_(output)

    return hook


def expert_parallel_hook(first: int, count: int) -> Hook:
    """Pre-hook of a rank's experts ``[first, first + count)``: global ids to local ones.

    Pairs routed to another rank's expert keep their row but get weight 0 and
    local id 0, so the ops keep their shapes (no host sync, graph-safe) and
    add exactly nothing; the owning rank adds the real contribution and the
    all-reduce sums them.  The price: those pairs are still computed once,
    by local expert 0 (see docs/distributed.md).
    """

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, weights, ids = args
        local = ids - first
        mine = (local >= 0) & (local < count)
        return x, weights.masked_fill(~mine, 0), local.masked_fill(~mine, 0)

    return hook


def sequence_parallel_block_hooks(
    comm: Collectives, context: SequenceParallelContext
) -> tuple[Hook, Hook]:
    """(pre, post) hooks of an MoE block: route this rank's chunk, return every token's output."""

    def pre(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        chunk, padded = split_rows(x, comm.size, comm.rank)
        context.num_tokens = x.shape[0]
        context.chunk = chunk.shape[0]
        context.padded_input = padded
        return (chunk, *args[1:])

    def post(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        context.padded_input = None
        return comm.all_gather_rows(output)[: context.num_tokens]

    return pre, post


def sequence_parallel_experts_hooks(
    comm: Collectives, context: SequenceParallelContext
) -> tuple[Hook, Hook]:
    """(pre, post) hooks of the experts under a sequence-parallel block.

    The experts hold a slice of every expert (TP) or whole experts (EP), so
    they need every rank's tokens: gather the routing, take the padded input
    the block hook kept, and reduce-scatter the partial outputs back to chunks.
    """

    def pre(module: nn.Module, args: tuple) -> tuple:
        _chunk, weights, ids = args
        return context.padded_input, comm.all_gather_rows(weights), comm.all_gather_rows(ids)

    def post(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return comm.reduce_scatter_rows(output)

    return pre, post
