"""Context parallelism: each sequence split over the "cp" ranks of the context mesh, which hold
the same batch and share its sequences' attention.

A sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); rank r holds chunk r and chunk
2 cp - 1 - r. Under causal attention a chunk's cost grows with its place in the sequence, so the
pair costs every rank the same (the load balancing of Megatron's and PyTorch's context
parallelism). Two modules of the model take part, named by its family's plan:

- the model itself: its class becomes a subclass whose forward takes the whole batch, runs the
  plain forward on this rank's chunks at their own positions (``positions=``), and returns the
  whole sequences' mean loss, the same on every rank of the group (or, without targets, the
  whole sequences' logits);
- each block's attention: its ``attend`` gathers the keys and values of every rank of the group
  (one all-gather per layer, whose backward reduce-scatters their gradients) and runs each of
  its two chunks' queries over the keys up to the chunk's end, causally aligned at the end (the
  all-gather variant of ring attention, as Llama 3 trained long context: with grouped-query
  attention the keys and values are the smaller half of the traffic).

Decoding (a kv cache) runs the plain forward on every rank: generation is not split.

Gradients: the group's loss is the sum over its ranks of each one's share, made by an all-reduce
whose backward scales the (equal) incoming gradient by cp instead of communicating; data-parallel
training then averages each rank's gradients over all data-parallel ranks, cp included, which
gives the gradient of the sequence's loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100


def local_positions(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of a sequence of ``length`` tokens that context-parallel rank ``rank`` of
    ``cp`` holds: its head chunk, then its tail chunk."""
    if length % (2 * cp):
        raise ValueError(
            f"a sequence of {length} tokens does not cut into 2 x parallel.cp = {2 * cp} equal chunks "
            "(2 x parallel.cp must divide data.seq_len)"
        )
    chunk = length // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat((head, head.new_tensor(range(length - (rank + 1) * chunk, length - rank * chunk))))


def _renamed(module: Any, name: str, old: str) -> Any:
    """``module.name``, or ``module.old`` where this PyTorch predates the name (2.13 renamed the
    single-tensor collectives and deprecates the old names)."""
    return getattr(module, name, None) or getattr(module, old)


class _GatherSequence(torch.autograd.Function):
    """The chunks of every rank of ``group`` stacked on dim 0, forward; backward, the gradient of
    this rank's chunk summed over the ranks that used it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _renamed(dist, "all_gather_single", "all_gather_into_tensor")(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        out = grad.new_empty((grad.size(0) // ctx.size, *grad.shape[1:]))
        _renamed(dist, "reduce_scatter_single", "reduce_scatter_tensor")(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _SumOverGroup(torch.autograd.Function):
    """The sum of ``x`` over the ranks of ``group``, forward; backward, the incoming gradient,
    which is the same on every rank (each computes the same loss from the sum), times the
    group's size: data-parallel training averages it back over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.size = size
        x = x.detach().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.size, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Any, cp: int) -> torch.Tensor:
    """The whole sequences of ``x``, each rank of ``group`` holding its chunks along ``dim``, in
    their order in the sequence (differentiable)."""
    moved = x.movedim(dim, 0)
    stacked = _GatherSequence.apply(moved, group, cp)
    length = stacked.size(0)
    held = torch.cat([local_positions(length, cp, r, x.device) for r in range(cp)])
    return stacked[held.argsort()].movedim(0, dim)


class ContextParallelAttention:
    """The ``attend`` of an attention module whose queries are this rank's two chunks (mixed
    into its class)."""

    _cp_group: Any
    _cp: int
    _cp_rank: int

    def attend(self, q, k, v, mask=None, causal=True):
        if mask is not None or not causal:  # decoding over a kv cache: not split
            return super().attend(q, k, v, mask, causal)  # type: ignore[misc]
        from torch.nn.attention.bias import causal_lower_right

        keys = gather_sequence(k, 2, self._cp_group, self._cp)
        values = gather_sequence(v, 2, self._cp_group, self._cp)
        if (group := q.size(1) // k.size(1)) > 1:
            # Repeated for the query heads here, once: the head chunk's keys are a prefix of the
            # tail chunk's, so the two calls share (and autograd saves) one copy.
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        length, chunk = keys.size(2), q.size(2) // 2
        outs = []
        for part, end in ((0, (self._cp_rank + 1) * chunk), (1, length - self._cp_rank * chunk)):
            # Query i of a chunk ending at ``end`` sees keys 0..end - chunk + i: a causal mask
            # aligned to the lower right corner, which flash kernels run without a mask tensor.
            queries = q[:, :, part * chunk : (part + 1) * chunk]
            bias = causal_lower_right(chunk, end)
            outs.append(super().attend(queries, keys[:, :, :end], values[:, :, :end], bias, False))  # type: ignore[misc]
        return torch.cat(outs, dim=2)


class ContextParallelModel:
    """The forward of a model whose sequences are split over the "cp" ranks (mixed into its class)."""

    _cp_group: Any
    _cp: int
    _cp_rank: int

    def forward(self, idx, targets=None, kv_cache=None, start_pos=0):
        if kv_cache is not None:  # decoding: every rank runs the whole sequence
            return super().forward(idx, targets, kv_cache, start_pos)  # type: ignore[misc]
        held = local_positions(idx.size(1), self._cp, self._cp_rank, idx.device)
        if targets is None:
            logits = super().forward(idx[:, held], positions=held)  # type: ignore[misc]
            return gather_sequence(logits, 1, self._cp_group, self._cp)
        mine = targets[:, held]
        loss = super().forward(idx[:, held], mine, positions=held)  # type: ignore[misc]
        # This rank's share of the sequences' mean loss: its mean over its counted tokens, weighed
        # by its part of them (a chunk can hold fewer, e.g. past a completion's end).
        share = (mine != IGNORE_INDEX).sum() / (targets != IGNORE_INDEX).sum().clamp(min=1)
        return _SumOverGroup.apply(loss * share, self._cp_group, self._cp)


def apply_cp(model: nn.Module, attentions: list[nn.Module], cp_mesh: Any) -> None:
    """Make ``model`` split its sequences over ``cp_mesh`` (the 1-D mesh of this rank's "cp"
    ranks), with ``attentions`` (each block's attention module) attending across the chunks (in
    place)."""
    group, size, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    for module, mixin in ((model, ContextParallelModel), *((a, ContextParallelAttention) for a in attentions)):
        cls = type(module)
        module.__class__ = type(f"ContextParallel{cls.__name__}", (mixin, cls), {})
        module._cp_group, module._cp, module._cp_rank = group, size, rank
