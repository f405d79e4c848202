"""One optimizer step's arithmetic, the same for the training loop, the micro-batch probe, the
non-finite guard's replay and the doctor: each micro-batch's loss under the run's precision, its
backward scaled so that the summed gradients are those of one big batch, then unscale, clip and
the update, skipped on the device when the gradient norm is not finite.

The step's loss is token-exact: the sum over every counted token (or item) of the global batch
divided by how many there are, over all micro-batches and data-parallel ranks, so neither
accumulation nor the world size changes the gradient when micro-batches hold different numbers
of loss tokens (padded or packed fine-tuning data). The counts are known on the host
(``TokenBatch``), so weighing the micro-batches costs one small host-side all-reduce, no sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.data.batch import batch_rows, loss_count
from kiln.distributed.parallelize import clip_grad_norm_, gradient_sync
from kiln.distributed.pipeline import Pipeline
from kiln.models.family import ParallelPlan
from kiln.train.apply import apply_activation_checkpointing
from kiln.train.faults import Faults
from kiln.train.precision import Precision
from kiln.train.straggler import BusyClock

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class TrainStep:
    """``model`` is what the loss function calls (a DDP wrapper, say); ``plain`` the model
    itself, to which activation checkpointing is applied along ``plan``'s repeated layers. With a
    ``pipeline`` (pipeline parallelism), its schedule runs each micro-batch's forward and
    backward instead, and the loss function is not called."""

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
        dp_total: Callable[[int], int] = int,
        dp: int = 1,
        pipeline: Pipeline | None = None,
        busy: BusyClock | None = None,
    ):
        self.model = model
        self.plain = plain if plain is not None else model
        self.plan = plan
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.precision = precision
        self.clip = grad_clip if grad_clip > 0 else math.inf
        self.faults = faults or Faults()
        # Times this rank's forward passes, its own work (no collectives wait there under DDP).
        self.busy = busy or BusyClock()
        # The sum of a host-side count over the data-parallel ranks, and their number.
        self.dp_total, self.dp = dp_total, dp
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.checkpointing = False
        self.pipeline = pipeline
        # Each pipeline rank holds some of the layers: the gradient norm sums over all of them.
        self.norm_group = pipeline.group if pipeline is not None else None

    def recompute_activations(self) -> None:
        """Turn activation checkpointing on (once): recompute each layer in the backward pass."""
        if not self.checkpointing:
            apply_activation_checkpointing(self.plain, self.plan)
            self.checkpointing = True

    def loss(self, micro_batch: Any, step: int) -> torch.Tensor:
        """The loss of one micro-batch of (1-based) ``step``, under the run's precision."""
        with self.busy.device():
            self.faults.before_forward(step, batch_rows(micro_batch), self.checkpointing)
            with self.precision.autocast():
                return self.loss_fn(self.model, micro_batch)

    def forward_backward(self, micro_batches: list[Any], step: int, *, sync: bool = True) -> torch.Tensor:
        """Gradients of the micro-batches, accumulated; the step's loss (on the device).

        Each micro-batch loss is a mean over its own counted tokens; dividing it by the global
        count over its own count (times the data-parallel ranks, which average their gradients)
        makes the summed gradients those of one big batch. Micro-batches that do not know their
        count weigh the same: the divisor is their number. Data-parallel ranks reduce gradients
        on the last micro-batch only, unless ``sync`` is off."""
        n = len(micro_batches)
        counts = [loss_count(m) for m in micro_batches]
        counted = None not in counts
        if counted:
            total_count = self.dp_total(sum(counts))
            # A micro-batch without counted tokens contributes nothing (its loss is a 0 / 0).
            divisors = [total_count / (c * self.dp) if c else math.inf for c in counts]
        else:
            divisors = [n] * n
        total = None
        for i, micro in enumerate(micro_batches):
            if self.pipeline is not None:  # its schedule runs forward and backward; reduced below
                self.faults.before_forward(step, batch_rows(micro), self.checkpointing)
                with self.precision.autocast():
                    loss = self.pipeline.forward_backward(micro, 1 / divisors[i])
            else:
                with gradient_sync(self.model, sync and i == n - 1):
                    loss = self.loss(micro, step)
                    self.precision.backward(loss / divisors[i])
            if total is None:
                total = torch.zeros((), device=loss.device)
            # This rank's share of the step's loss, times the ranks (the meter averages over them).
            total += loss.detach() / divisors[i] if counted else loss.detach()
        if self.pipeline is not None and sync:
            self.pipeline.reduce_gradients()
        return total if counted else total / n

    def update(self, lr: float, inspect: Callable[[nn.Module], None] | None = None) -> torch.Tensor:
        """Unscale, clip, step at ``lr`` and clear the gradients; the gradient norm before clipping.
        ``inspect(model)`` sees the unscaled gradients before they are clipped."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.precision.unscale_(self.optimizer)
        if inspect is not None:
            inspect(self.plain)
        uncounted = self.pipeline.uncounted if self.pipeline is not None else ()
        grad_norm = clip_grad_norm_(self.params, self.clip, group=self.norm_group, uncounted=uncounted)
        # A NaN/Inf gradient norm (the same on every rank) skips the update, on the device.
        self.precision.step(self.optimizer, finite=torch.isfinite(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def discard_gradients(self) -> None:
        """Drop the partial gradients of a failed attempt (and, on a GPU, the cached blocks)."""
        self.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
