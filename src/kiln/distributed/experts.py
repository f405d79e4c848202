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

A ``transformers`` experts module (the plan's ``experts_call``) is called with each token's
chosen experts and their weights instead: the hook before it sends each (token, expert) pair's
row, grouped by expert, the same way, and calls it with the rows of this rank's experts, each
row's expert and a weight of 1; it computes them with its weights' local parts through
``transformers``' experts interface (``local_experts``, registered there under
``EXPERT_PARALLEL``); the hook after it brings the rows back and sums each token's, weighed.

Each rank's experts see the tokens of all ``ep`` ranks, so their gradients sum what ``ep`` ranks'
losses give; data-parallel training averages each rank's gradients over the data-parallel ranks
(FSDP over "ep_shard" averages over the rest), so the weights' gradients are divided by ``ep``
once more: the results' gradient is, on its way back into the forward, and the rows' gradient
multiplied by ``ep`` again on its way out, which leaves the tokens' gradients as they were.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.family import TRANSFORMERS_EXPERTS

# The name kiln's experts function has in transformers' experts interface.
EXPERT_PARALLEL = "kiln_expert_parallel"


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
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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


class _Pairs(_Routes):
    """The routes of a ``transformers`` experts module, called with (hidden states [tokens, d],
    each token's experts [tokens, k], their weights [tokens, k])."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, torch.dtype]] = []

    def dispatch_pairs(self, module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[torch.Tensor, ...]:
        x, chosen, weights = inputs
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, expert) pairs grouped by expert
        ends = torch.bincount(flat, minlength=cast(Any, module).num_experts).cumsum(0)
        rows, local_ends = self.dispatch(module, (x[order // chosen.size(1)], ends), mesh)
        self.pairs.append((order, weights, x.dtype))
        expert = torch.repeat_interleave(torch.diff(local_ends, prepend=local_ends.new_zeros(1)))
        return rows, expert[:, None], torch.ones(len(rows), 1, dtype=weights.dtype, device=rows.device)

    def combine_pairs(self, module: nn.Module, out: torch.Tensor, mesh: Any) -> torch.Tensor:
        order, weights, dtype = self.pairs.pop(0)
        back = self.combine(module, out, mesh)
        pairs = torch.empty_like(back).index_copy_(0, order, back).view(*weights.shape, -1)
        return (pairs * weights[..., None]).sum(1).to(dtype)


def local_experts(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A ``transformers`` experts module's forward on its weights' local parts, for rows grouped
    by this rank's experts (``top_k_index`` [rows, 1], ascending) as ``_Pairs`` sends them."""
    experts: Any = module
    gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
    counts = torch.bincount(top_k_index.flatten(), minlength=gate_up.size(0)).tolist()
    out = [
        F.linear(experts._apply_gate(F.linear(rows, gate_up[e])), down[e])
        for e, rows in enumerate(hidden_states.split(counts))
    ]
    return torch.cat(out) * top_k_weights


def _use_local_experts(experts: list[nn.Module]) -> None:
    """Make ``experts`` (``transformers`` modules sharing their model's config) compute through
    ``local_experts``, registered in ``transformers``' experts interface."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERT_PARALLEL, local_experts)
    for module in experts:
        cast(Any, module).config._experts_implementation = EXPERT_PARALLEL


def apply_ep(experts: list[nn.Module], ep_mesh: Any, call: str = "") -> None:
    """Split each experts module's weights over ``ep_mesh`` (a 1-D mesh of the "ep" ranks) by
    their first dimension and route its rows to the ranks of their experts (in place; the model
    may be on ``meta``). ``call``: the plan's ``experts_call``."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    def split(name: str, module: nn.Module, mesh: Any) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            parts = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(parts, requires_grad=param.requires_grad))

    for module in experts:
        # The hooks return the forward's new inputs and the module's new output (distribute_module
        # installs them as its forward hooks; its annotations say None).
        hooks: dict[str, Any]
        if call == TRANSFORMERS_EXPERTS:
            pairs = _Pairs()
            hooks = {"input_fn": pairs.dispatch_pairs, "output_fn": pairs.combine_pairs}
        else:
            routes = _Routes()
            hooks = {"input_fn": routes.dispatch, "output_fn": routes.combine}
        distribute_module(module, ep_mesh, split, **hooks)
    if call == TRANSFORMERS_EXPERTS:
        _use_local_experts(experts)
