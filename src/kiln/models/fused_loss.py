"""Output projection and cross-entropy in one pass, a chunk of tokens at a time.

The plain path materialises the logits [N, V], then log-softmax over them, then the gradient of
both: four full [N, V] buffers in fp32. At a small width the vocabulary projection is the largest
matmul and those buffers are most of the step's memory traffic. Here each chunk's logits are
reduced to its loss and turned into its gradient (softmax minus one-hot) immediately, and the
gradients with respect to the hidden states and the weight are accumulated during the forward pass;
backward only scales them. Nothing of size [N, V] outlives a chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from kiln.labels import IGNORE_INDEX


class VocabShard(NamedTuple):
    """A weight that holds rows ``start``.. of the vocabulary, the other rows on other ranks
    (vocabulary-parallel output layer, loss parallelism): ``reduce_max`` and ``reduce_sum`` combine
    a per-token [rows] tensor in place over those ranks. Each rank then computes the logits of its
    rows only; the log-sum-exp and the target's logit are reduced across them, so no rank holds
    a [tokens, vocab] buffer. The gradient with respect to the hidden states is each rank's
    part, which the caller sums over the ranks (the backward of the gather that gave every rank
    the hidden states)."""

    start: int
    reduce_max: Callable[[torch.Tensor], None]
    reduce_sum: Callable[[torch.Tensor], None]


def _matmul_weight(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``weight`` in the dtype the chunks' products run in: under autocast, cast once here rather
    than by autocast in each chunk's products (on an H100/H200 at GPT-2's vocabulary those casts
    of the fp32 weight were 3 ms of a 68-ms step; BENCHMARKS.md, "Sixth lease")."""
    if torch.is_autocast_enabled(device.type):
        return weight.to(torch.get_autocast_dtype(device.type))
    return weight


def _chunk_loss_and_grad(h, weight, targets, keep, want_grad, softcap=0.0, shard: VocabShard | None = None):
    """Summed loss of one chunk, and the gradient of that sum with respect to its logits (or None).
    With ``softcap`` the logits are ``softcap * tanh(logits / softcap)``, and the gradient is
    taken through that too. With ``shard``, ``weight`` holds some of the vocabulary's rows (see
    VocabShard): the logits and their gradient are those rows'."""
    logits = (h @ weight.t()).to(torch.promote_types(weight.dtype, torch.float32))
    squashed = None
    if softcap:
        squashed = torch.tanh(logits / softcap)
        logits = squashed * softcap
    local = targets - (shard.start if shard else 0)
    here = (local >= 0) & (local < weight.size(0)) if shard else targets != IGNORE_INDEX
    safe = torch.where(here, local, 0)
    picked = logits.gather(1, safe[:, None]).squeeze(1) * here
    # One exp pass serves both the log-sum-exp and the softmax, in place in the logits' buffer.
    top = logits.amax(dim=-1, keepdim=True)
    if shard:  # the largest logit over every rank's rows, the target's from the rank that has it
        shard.reduce_max(top)
        shard.reduce_sum(picked)
    probs = logits.sub_(top).exp_()
    sums = probs.sum(dim=-1, keepdim=True)
    if shard:
        shard.reduce_sum(sums)
    lse = (sums.log() + top).squeeze(1)
    loss = ((lse - picked) * keep).sum()
    if not want_grad:
        return loss, None
    grad = probs.mul_(keep[:, None] / sums)
    grad.scatter_add_(1, safe[:, None], -(keep * here)[:, None])
    if squashed is not None:
        grad.mul_(1 - squashed * squashed)
    return loss, grad


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, softcap, shard):
        acc = torch.promote_types(weight.dtype, torch.float32)
        keep_all = (targets != IGNORE_INDEX).to(acc)
        count = keep_all.sum()
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        w = _matmul_weight(weight, hidden.device)
        # Under autocast (w in the low precision) the products stay out of place, then add into fp32.
        in_place = w.dtype == acc
        for start in range(0, hidden.size(0), chunk_size):
            end = start + chunk_size
            h = hidden[start:end].to(w.dtype)
            loss, grad = _chunk_loss_and_grad(h, w, targets[start:end], keep_all[start:end], True, softcap, shard)
            total += loss
            grad = grad.to(w.dtype)
            grad_h[start:end] = grad @ w
            if in_place:
                grad_w.addmm_(grad.t(), h)
            else:
                grad_w += grad.t() @ h
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total / count.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_out / count.clamp(min=1)
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * scale).to(h_dtype), (grad_w * scale).to(w_dtype), None, None, None, None


class _LinearLogProbs(torch.autograd.Function):
    """Each row's log-probability of its target (0 where ignored), a chunk of rows at a time. The
    gradient depends on each row's weight in the caller's loss, so backward recomputes each
    chunk's logits (one more projection) rather than keeping [N, V] of them. With ``shard``,
    ``weight`` holds some of the vocabulary's rows (see VocabShard): the log-sum-exp and the
    target's logit are reduced over the ranks, and each row's log-sum-exp kept for the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, shard):
        acc = torch.promote_types(weight.dtype, torch.float32)
        out = torch.zeros(hidden.size(0), dtype=acc, device=hidden.device)
        lse = torch.zeros(hidden.size(0) if shard else 0, dtype=acc, device=hidden.device)
        w = _matmul_weight(weight, hidden.device)
        for start in range(0, hidden.size(0), chunk_size):
            end = start + chunk_size
            logits = (hidden[start:end].to(w.dtype) @ w.t()).to(acc)
            t = targets[start:end]
            if shard is None:
                picked = logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
                out[start:end] = (picked - logits.logsumexp(dim=-1)) * (t != IGNORE_INDEX)
                continue
            local = t - shard.start
            here = (local >= 0) & (local < weight.size(0))
            picked = logits.gather(1, torch.where(here, local, 0)[:, None]).squeeze(1) * here
            top = logits.amax(dim=-1)
            shard.reduce_max(top)
            sums = (logits - top[:, None]).exp().sum(dim=-1)
            shard.reduce_sum(sums)
            shard.reduce_sum(picked)
            lse[start:end] = sums.log() + top
            out[start:end] = (picked - lse[start:end]) * (t != IGNORE_INDEX)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.shard = chunk_size, shard
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        shard = ctx.shard
        acc = torch.promote_types(weight.dtype, torch.float32)
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        w = _matmul_weight(weight, hidden.device)
        for start in range(0, hidden.size(0), ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end].to(w.dtype)
            t = targets[start:end]
            g = (grad_out[start:end] * (t != IGNORE_INDEX)).to(acc)
            # d log p(t) / d logits = one-hot(t) - softmax, times the row's weight in the loss.
            logits = (h @ w.t()).to(acc)
            if shard is None:
                grad = logits.softmax(dim=-1).mul_(-g[:, None])
                grad.scatter_add_(1, t.clamp(min=0)[:, None], g[:, None])
            else:  # this rank's columns of the softmax, and of the one-hot where it holds the target
                local = t - shard.start
                here = (local >= 0) & (local < weight.size(0))
                grad = logits.sub_(lse[start:end, None]).exp_().mul_(-g[:, None])
                grad.scatter_add_(1, torch.where(here, local, 0)[:, None], (g * here)[:, None])
            grad = grad.to(w.dtype)
            if grad_h is not None:
                grad_h[start:end] = grad @ w
            if grad_w is not None:
                grad_w += grad.t() @ h
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
        )


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """log p(target) [N] of each row of ``hidden [N, D] @ weight[V, D].T`` under its softmax, in
    fp32, chunk by chunk (0 where the target is -100): what preference and RL objectives sum, with
    no [N, V] buffer outliving its chunk in the forward or the backward pass. With ``shard``,
    ``weight`` is this rank's rows of a vocabulary split over ranks (see VocabShard)."""
    chunk_size = chunk_size or default_chunk_size(weight.size(0), hidden.device.type)
    return _LinearLogProbs.apply(hidden, weight, targets, chunk_size, shard)


def default_chunk_size(vocab_size: int, device: str = "cpu") -> int:
    """Rows per chunk. On a CPU about 8 MiB of fp32 logits, cache-sized (measured fastest there),
    never fewer than 256 rows. On a GPU about 1 GiB: each chunk's three matmuls must fill the
    card, and the per-chunk launches add up (on an H100 at GPT-2's vocabulary, eagerly, 256 rows
    took twice as long as 4096 or more; BENCHMARKS.md, "Fifth lease")."""
    return max(256, (1 << 21 if device == "cpu" else 1 << 28) // vocab_size)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int | None = None,
    softcap: float = 0.0,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden [N, D] @ weight[V, D].T`` (soft-capped to
    ``softcap * tanh(logits / softcap)`` if ``softcap``) against ``targets [N]``, computed in fp32
    chunk by chunk; targets equal to -100 are left out of the mean. With ``shard``, ``weight`` is
    this rank's rows of a vocabulary split over ranks (see VocabShard)."""
    chunk_size = chunk_size or default_chunk_size(weight.size(0), hidden.device.type)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, chunk_size, softcap, shard)
    keep = (targets != IGNORE_INDEX).to(torch.promote_types(weight.dtype, torch.float32))
    w = _matmul_weight(weight, hidden.device)
    hidden = hidden.to(w.dtype)
    total = sum(
        _chunk_loss_and_grad(
            hidden[s : s + chunk_size], w, targets[s : s + chunk_size], keep[s : s + chunk_size], False, softcap, shard
        )[0]
        for s in range(0, hidden.size(0), chunk_size)
    )
    return total / keep.sum().clamp(min=1)


class LinearCrossEntropy(nn.Module):
    """The output layer's loss as a module of its own, without parameters: ``forward(hidden [B, T,
    D], weight [V, D], targets [B, T])`` is ``linear_cross_entropy`` of them. A module so that a
    layout can put another in its place (tensor parallelism's computes it on a vocabulary split
    over ranks: ``kiln.distributed.loss_parallel``)."""

    def __init__(self, softcap: float = 0.0):
        super().__init__()
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden.flatten(0, 1), weight, targets.flatten(), softcap=self.softcap)

    def log_probs(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each target's log-probability [B, T] (0 where it is -100), in fp32: ``linear_log_probs``."""
        return linear_log_probs(hidden.flatten(0, 1), weight, targets.flatten()).view(targets.shape)
