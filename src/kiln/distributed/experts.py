"""Expert parallelism: a mixture of experts' experts split over the "ep" ranks of the world's
mesh, each rank computing its own experts for the tokens of every rank of its group.

A block's experts module (the plan's ``experts``, e.g. ``mlp.experts``) takes part by holding its
weights with the experts as their first dimension, by a ``forward(x, ends)`` whose rows ``x`` come
grouped by expert (expert e's rows end at ``ends[e]``), and by computing with its weights' local
parts where they are split (``to_local``). ``apply_ep`` lays it out with PyTorch's
``distribute_module``: its weights become DTensors split on that first dimension over "ep" (so
that checkpoints, DCP and initialisation see whole tensors), and two hooks around its forward

1. before it, tell every rank of the group how many of its rows go to each of that rank's experts
   (one all-to-all of counts; their sums are read on the host to size the exchange), and send each
   rank the rows of its experts (an all-to-all, with autograd), which arrive grouped by sender,
   then by expert; regrouped by expert alone, they are the forward's rows;
2. after it, send the results back the same way, in the order the rows came.

Each rank's experts see the tokens of all ``ep`` ranks, so their gradients sum what ``ep`` ranks'
losses give; data-parallel training averages each rank's gradients over the data-parallel ranks
(FSDP over "ep_shard" averages over the rest), so the weights' gradients are divided by ``ep``
once more: the results' gradient is, on its way back into the forward, and the rows' gradient
multiplied by ``ep`` again on its way out, which leaves the tokens' gradients as they were.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """The rows of ``x`` sent to the ranks of ``group`` (``in_splits[r]`` rows to rank r), and the
    rows they send here (``out_splits[r]`` from rank r), differentiable.

    PyTorch 2.13 deprecates the public ``torch.distributed.nn.functional.all_to_all_single`` for
    this private functional collective, which only this function calls;
    ``tests/distributed/test_experts.py`` fails if it changes."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)


class _ScaledGradient(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _Routes:
    """How one forward's rows went to the experts' ranks, from the hook before it to the hook
    after it (activation checkpointing's recomputation runs both again, in the same order)."""

    def __init__(self) -> None:
        self.pending: list[tuple[list[int], list[int], torch.Tensor]] = []

    def dispatch(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        x, ends = inputs
        group, ep = mesh.get_group(), mesh.size()
        local = cast(Any, next(module.parameters(recurse=False))).to_local().shape[0]  # a DTensor
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int64)
        # received[r, e]: rows rank r sends to this rank's expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        received = received.view(ep, local)
        sends, takes = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        rows = exchange(x, takes, sends, group)
        expert = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.flatten())
        order = expert.argsort(stable=True)
        self.pending.append((sends, takes, order))
        local_ends = received.sum(0).cumsum(0).to(torch.int32)
        return _ScaledGradient.apply(rows[order], float(ep)), local_ends

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: Any) -> torch.Tensor:
        sends, takes, order = self.pending.pop(0)
        out = _ScaledGradient.apply(out, 1.0 / mesh.size())
        back = torch.empty_like(out).index_copy_(0, order, out)
        return exchange(back, sends, takes, mesh.get_group())


def apply_ep(experts: list[nn.Module], ep_mesh: Any) -> None:
    """Split each experts module's weights over ``ep_mesh`` (a 1-D mesh of the "ep" ranks) by
    their first dimension and route its rows to the ranks of their experts (in place; the model
    may be on ``meta``)."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    def split(name: str, module: nn.Module, mesh: Any) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            parts = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(parts, requires_grad=param.requires_grad))

    for module in experts:
        routes = _Routes()
        # The hooks return the forward's new inputs and the module's new output (distribute_module
        # installs them as its forward hooks; its annotations say None).
        hooks: dict[str, Any] = {"input_fn": routes.dispatch, "output_fn": routes.combine}
        distribute_module(module, ep_mesh, split, **hooks)
