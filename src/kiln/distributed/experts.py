"""Expert parallelism: a mixture of experts' experts split over the "ep" ranks of the expert mesh,
each rank computing its own experts for the tokens of every rank of its group.

A block's experts module (the plan's ``experts``, e.g. ``mlp.experts``) takes part by holding its
weights with the experts as their first dimension and by two methods: ``forward(x, ends)``, whose
rows ``x`` come grouped by expert (expert e's rows end at ``ends[e]``), and ``compute(x, ends,
*weights)``, the same with the given weights (its parameters' local slices here). Its weights
become DTensors split on that first dimension over "ep" (so that checkpoints, DCP and
initialisation see whole tensors), and its class a subclass whose forward

1. tells every rank of the group how many of its rows go to each of that rank's experts (one
   all-to-all of counts; their sums are read on the host to size the exchange),
2. sends each rank the rows of its experts (an all-to-all, with autograd), which arrive grouped
   by sender, then by expert; regrouped by expert alone, they go through ``compute`` with the
   local weights,
3. and sends the results back the same way, in the order the rows came.

Each rank's experts see the tokens of all ``ep`` ranks, so their gradients sum what ``ep`` ranks'
losses give; data-parallel training averages each rank's gradients over the data-parallel ranks
(FSDP over "dp_rep" averages over the rest), so the weights' gradients are divided by ``ep``
once more here, as they flow back.
"""

from __future__ import annotations

from typing import Any

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


class ExpertParallel:
    """The forward of an experts module split over the "ep" ranks (mixed into its class)."""

    _ep_group: Any
    _ep: int

    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        weights = [p.to_local() for p in self.parameters(recurse=False)]  # type: ignore[attr-defined]
        local = weights[0].shape[0]
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int64)
        # received[r, e]: rows rank r sends to this rank's expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self._ep_group)
        received = received.view(self._ep, local)
        sends, takes = counts.view(self._ep, local).sum(1).tolist(), received.sum(1).tolist()
        rows = exchange(x, takes, sends, self._ep_group)
        expert = torch.arange(local, device=x.device).repeat(self._ep).repeat_interleave(received.flatten())
        order = expert.argsort(stable=True)
        local_ends = received.sum(0).cumsum(0).to(torch.int32)
        scaled = [_ScaledGradient.apply(w, 1.0 / self._ep) for w in weights]
        out = self.compute(rows[order], local_ends, *scaled)  # type: ignore[attr-defined]
        back = torch.empty_like(out).index_copy_(0, order, out)
        return exchange(back, sends, takes, self._ep_group)


def apply_ep(experts: list[nn.Module], ep_mesh: Any) -> None:
    """Split each experts module's weights over ``ep_mesh`` (a 1-D mesh of the "ep" ranks) by
    their first dimension and make its forward exchange tokens (in place; the model may be on
    ``meta``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(split, requires_grad=param.requires_grad))
        cls = type(module)
        module.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
        module._ep_group, module._ep = ep_mesh.get_group(), ep_mesh.size()
