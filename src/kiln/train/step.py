"""One optimizer step's arithmetic, the same for the training loop, the micro-batch probe, the
non-finite guard's replay and the doctor: each micro-batch's loss under the run's precision, its
backward scaled so that the summed gradients are those of one big batch, then unscale, clip and
the update, skipped on the device when the gradient norm is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.data.batch import batch_rows
from kiln.distributed.parallelize import clip_grad_norm_, gradient_sync
from kiln.models.family import ParallelPlan
from kiln.train.apply import apply_activation_checkpointing
from kiln.train.faults import Faults
from kiln.train.precision import Precision

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class TrainStep:
    """``model`` is what the loss function calls (a DDP wrapper, say); ``plain`` the model
    itself, to which activation checkpointing is applied along ``plan``'s repeated layers."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        *,
        grad_clip: float,
        plain: nn.Module | None = None,
        plan: ParallelPlan | None = None,
        faults: Faults | None = None,
    ):
        self.model = model
        self.plain = plain if plain is not None else model
        self.plan = plan
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.precision = precision
        self.clip = grad_clip if grad_clip > 0 else math.inf
        self.faults = faults or Faults()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.checkpointing = False

    def recompute_activations(self) -> None:
        """Turn activation checkpointing on (once): recompute each layer in the backward pass."""
        if not self.checkpointing:
            apply_activation_checkpointing(self.plain, self.plan)
            self.checkpointing = True

    def loss(self, micro_batch: Any, step: int) -> torch.Tensor:
        """The loss of one micro-batch of (1-based) ``step``, under the run's precision."""
        self.faults.before_forward(step, batch_rows(micro_batch), self.checkpointing)
        with self.precision.autocast():
            return self.loss_fn(self.model, micro_batch)

    def forward_backward(self, micro_batches: list[Any], step: int, *, sync: bool = True) -> torch.Tensor:
        """Gradients of the micro-batches, accumulated; their mean loss (on the device).

        Each micro-batch loss is a mean, so dividing by the number of micro-batches makes the
        summed gradients those of one big batch (and data-parallel ranks average theirs, on the
        last micro-batch only unless ``sync`` is off)."""
        n = len(micro_batches)
        total = None
        for i, micro in enumerate(micro_batches):
            with gradient_sync(self.model, sync and i == n - 1):
                loss = self.loss(micro, step)
                self.precision.backward(loss / n)
            if total is None:
                total = torch.zeros((), device=loss.device)
            total += loss.detach()
        return total / n

    def update(self, lr: float, inspect: Callable[[nn.Module], None] | None = None) -> torch.Tensor:
        """Unscale, clip, step at ``lr`` and clear the gradients; the gradient norm before clipping.
        ``inspect(model)`` sees the unscaled gradients before they are clipped."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.precision.unscale_(self.optimizer)
        if inspect is not None:
            inspect(self.plain)
        grad_norm = clip_grad_norm_(self.params, self.clip)
        # A NaN/Inf gradient norm (the same on every rank) skips the update, on the device.
        self.precision.step(self.optimizer, finite=torch.isfinite(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def discard_gradients(self) -> None:
        """Drop the partial gradients of a failed attempt (and, on a GPU, the cached blocks)."""
        self.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
