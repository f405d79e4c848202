"""Loss parallelism: the output layer's loss computed on a vocabulary split over the "tp" ranks.

Under tensor parallelism the output layer's weight is split by rows (the vocabulary) over the
tensor-parallel ranks, as the embedding's is. ``VocabParallelCrossEntropy`` takes the place of a
model's loss module (``kiln.models.fused_loss.LinearCrossEntropy``, named by its family's plan):
each rank computes the logits of its own rows of the vocabulary, a chunk of tokens at a time,
and the log-sum-exp and the target's logit are all-reduced across the group (three [tokens]
vectors per chunk), so no rank ever holds a [tokens, vocab] buffer, nor computes the whole
vocabulary's logits. Each target's log-probability (what DPO and its family sum) is computed the
same way (``log_probs``). With sequence parallelism the hidden states arrive split by position over
the group: they are gathered first (whose backward reduce-scatters, summing each rank's part of
their gradient); without it they are whole on every rank, and their gradient is all-reduced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.models.fused_loss import VocabShard, linear_cross_entropy, linear_log_probs


class _Gather(torch.autograd.Function):
    """The positions of every rank of ``group``, forward: [B, T / n, D] -> [B, T, D]; backward,
    each rank's positions of the gradient summed over the group (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.size = group, size
        parts = x.movedim(1, 0).contiguous()
        out = parts.new_empty((size * parts.size(0), *parts.shape[1:]))
        dist.all_gather_into_tensor(out, parts, group=group)
        return out.movedim(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        whole = grad.movedim(1, 0).contiguous()
        out = whole.new_empty((whole.size(0) // ctx.size, *whole.shape[1:]))
        dist.reduce_scatter_tensor(out, whole, group=ctx.group)
        return out.movedim(0, 1), None, None


class _SumGradient(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over ``group`` (each rank computed its
    part of it from its rows of the vocabulary)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class VocabParallelCrossEntropy(nn.Module):
    """The mean cross-entropy of the output layer, its weight's rows split over ``tp_mesh``
    (``forward(hidden, weight, targets)`` as the loss module it replaces; ``weight`` a DTensor
    sharded by rows). ``sequence_parallel``: the hidden states come split by position."""

    def __init__(self, softcap: float, tp_mesh: Any, *, sequence_parallel: bool):
        super().__init__()
        self.softcap, self.sequence_parallel = softcap, sequence_parallel
        self.group, self.size, self.rank = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()

    # Eager under torch.compile: the chunks' loop and its in-place collectives are not traced
    # (dynamo hands the collectives DTensors); the layers around it compile.
    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor, weight: Any, targets: torch.Tensor) -> torch.Tensor:
        hidden, local, shard = self._parts(hidden, weight)
        return linear_cross_entropy(hidden.flatten(0, 1), local, targets.flatten(), softcap=self.softcap, shard=shard)

    @torch.compiler.disable
    def log_probs(self, hidden: torch.Tensor, weight: Any, targets: torch.Tensor) -> torch.Tensor:
        """Each target's log-probability [B, T] (0 where it is -100), in fp32, as the loss module's."""
        hidden, local, shard = self._parts(hidden, weight)
        return linear_log_probs(hidden.flatten(0, 1), local, targets.flatten(), shard=shard).view(targets.shape)

    def _parts(self, hidden: torch.Tensor, weight: Any) -> tuple[torch.Tensor, torch.Tensor, VocabShard]:
        """Every position's hidden states (their gradient summed over the group), this rank's rows
        of the output layer, and how they sit in the vocabulary."""
        import torch.distributed as dist

        hidden = hidden.to_local() if hasattr(hidden, "to_local") else hidden
        if self.sequence_parallel:
            hidden = _Gather.apply(hidden, self.group, self.size)
        else:
            hidden = _SumGradient.apply(hidden, self.group)
        local = weight.to_local()
        # DTensor splits rows as torch.chunk does: ceil(V / n) per rank, the last ones shorter.
        start = min(self.rank * -(-weight.size(0) // self.size), weight.size(0))

        def reduce_max(t: torch.Tensor) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

        def reduce_sum(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=self.group)

        return hidden, local, VocabShard(start, reduce_max, reduce_sum)
