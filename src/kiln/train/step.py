"""One optimizer step's arithmetic, the same for the training loop, the micro-batch probe, the
non-finite guard's replay and the doctor: each micro-batch's loss under the run's precision, its
backward scaled so that the summed gradients are those of one big batch, then unscale, clip and
the update, skipped on the device when the gradient norm is not finite.

The step's loss is token-exact: the sum over every counted token (or item) of the global batch
divided by how many there are, over all micro-batches and data-parallel ranks, so neither
accumulation nor the world size changes the gradient when micro-batches hold different numbers
of loss tokens (padded or packed fine-tuning data). The counts are known on the host
(``TokenBatch``), so weighing the micro-batches costs one small host-side all-reduce, no sync.

The step runs the same way on every layout: how a micro-batch's forward and backward run, how
gradients are reduced and how their norm is taken is the ``ParallelModel``'s business.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from kiln.config import TrainConfig
from kiln.data.batch import batch_rows, loss_count
from kiln.distributed.parallel import ParallelModel, Staged
from kiln.train.apply import apply_activation_checkpointing
from kiln.train.faults import NO_FAULTS, NoFaults
from kiln.train.precision import Precision
from kiln.train.straggler import BusyClock

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class TrainStep:
    """Steps ``model`` (a ``ParallelModel``) by ``loss_fn(module, batch)``, the mean loss of a
    micro-batch. ``train`` (a run's TrainConfig; None: eager, and full activation checkpointing
    once the memory ladder turns it on): ``compile`` compiles the loss function with the model's
    forward from the step after ``compile_after`` (a step number, so that a run and its
    resumption switch at the same step); ``activation_checkpointing`` and
    ``activation_checkpointing_every`` say how it recomputes. ``faults`` is told of each forward
    pass; ``busy`` times this rank's forward passes (for stragglers); ``say`` prints a line for
    the user."""

    def __init__(
        self,
        model: ParallelModel,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        *,
        grad_clip: float,
        train: TrainConfig | None = None,
        faults: NoFaults = NO_FAULTS,
        busy: BusyClock | None = None,
        say: Callable[[str], None] = lambda _: None,
    ):
        self.model = model
        t = train or TrainConfig(compile=False)
        # How activation checkpointing recomputes, once it is on.
        selective, every = t.activation_checkpointing == "selective", t.activation_checkpointing_every
        self.recompute = functools.partial(apply_activation_checkpointing, selective=selective, every=every)
        self.say = say
        self.loss_fn = loss_fn
        # The step after which the loss function is compiled (None: never, or done).
        self.compile_after: int | None = t.compile_after if t.compile is True else None
        self.compile_held = False
        self.deterministic = False
        self._compile_when_due(0)
        self.optimizer = optimizer
        self.precision = precision
        self.clip = grad_clip if grad_clip > 0 else math.inf
        self.faults = faults
        # Times this rank's forward passes, its own work (no collectives wait there under DDP).
        self.busy = busy or BusyClock()
        self.params = model.parameters()
        self.checkpointing = False

    # -- what the ParallelModel computes with (its StepCompute) --------------------------------

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        with self.busy.device(), self.precision.autocast():
            return self.loss_fn(model, batch)

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.precision.loss_scale(loss)

    def staged(self, model: nn.Module, batch: Any) -> Staged | None:
        form = getattr(self.loss_fn, "staged", None)
        if form is None:
            return None
        with self.busy.device(), self.precision.autocast():
            return form(model, batch)

    # -- the step --------------------------------------------------------------------------------

    def recompute_activations(self) -> None:
        """Turn activation checkpointing on (once): recompute each layer in the backward pass."""
        if not self.checkpointing:
            self.recompute(self.model.module, self.model.plan)
            self.checkpointing = True

    def _compile_when_due(self, step: int) -> None:
        """Compile the loss function before (1-based) ``step`` if it is due by then and no probe
        holds it (see hold_compile)."""
        if self.compile_after is None or step <= self.compile_after or self.compile_held:
            return
        if self.compile_after:  # a pause in a running run: say why
            self.say(f"kiln: compiling the model after step {self.compile_after} (train.compile_after) ...")
        self.loss_fn, self.compile_after = self.model.compile(self.loss_fn), None
        # Compiled for the CPU, some gradients (an embedding's) are summed in an order that
        # depends on the threads unless deterministic algorithms are asked for: two compiled runs,
        # or a run and its resumption, would drift apart by ~1e-8 a step. Asked for around the
        # compiled forward and backward (a process-wide switch, put back after), where it costs
        # nothing measurable; on a GPU it would slow kernels and needs cuBLAS settings.
        self.deterministic = self.model.world.device.type == "cpu"

    @contextlib.contextmanager
    def hold_compile(self) -> Iterator[None]:
        """Steps in here stay eager when the compile comes after some eager steps: the time plan's
        probe gauges the pace before the run, whose own compiled steps then fix the plan."""
        self.compile_held = bool(self.compile_after)
        try:
            yield
        finally:
            self.compile_held = False

    def forward_backward(self, micro_batches: list[Any], step: int, *, sync: bool = True) -> torch.Tensor:
        """Gradients of the micro-batches of (1-based) ``step``, accumulated; the step's loss (on
        the device).

        Each micro-batch loss is a mean over its own counted tokens; dividing it by the global
        count over its own count (times the ranks reading different batches, over which
        gradients are averaged) makes the summed gradients those of one big batch. Micro-batches that do not know their
        count weigh the same: the divisor is their number. Data-parallel ranks reduce gradients
        after the last micro-batch only, unless ``sync`` is off."""
        self._compile_when_due(step)
        n = len(micro_batches)
        counts = [loss_count(m) for m in micro_batches]
        counted = None not in counts
        world = self.model.world
        if counted:
            total_count = world.dp_total(sum(cast("list[int]", counts)))  # counted: none is None
            # A micro-batch without counted tokens contributes nothing (its loss is a 0 / 0).
            divisors = [total_count / (c * world.data_ranks) if c else math.inf for c in counts]
        else:
            divisors = [n] * n
        total = None
        for i, micro in enumerate(micro_batches):
            with self.busy.device():  # a slow rank's injected delay is its own work, as a forward pass is
                self.faults.before_forward(step, batch_rows(micro), self.checkpointing)
            with self._deterministic():
                loss = self.model.forward_backward(micro, divisors[i], last=sync and i == n - 1, compute=self)
            if total is None:
                total = torch.zeros((), device=loss.device)
            # This rank's share of the step's loss, times the ranks (the meter averages over them).
            total += loss / divisors[i] if counted else loss
        assert total is not None  # a step has at least one micro-batch
        return total if counted else total / n

    def replay(self, micro_batches: list[Any], step: int) -> None:
        """The forward passes of ``step``'s micro-batches again, without gradients, on the whole
        model (the guard looks for the first module whose output is not finite)."""
        assert self.model.whole is not None  # only replayed where this rank holds the whole model
        with torch.no_grad(), self._deterministic():
            for micro in micro_batches:
                self.faults.before_forward(step, batch_rows(micro), self.checkpointing)
                self.loss(self.model.whole, micro)

    @contextlib.contextmanager
    def _deterministic(self) -> Iterator[None]:
        """Deterministic algorithms (warn-only: an op without a deterministic kernel warns) while
        the compiled code runs, where ``deterministic`` asks for them; the process's setting after."""
        if not self.deterministic:
            yield
            return
        before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])

    def update(self, lr: float, inspect: Callable[[nn.Module], None] | None = None) -> torch.Tensor:
        """Unscale, clip, step at ``lr`` and clear the gradients; the gradient norm before clipping.
        ``inspect(module)`` sees the unscaled gradients before they are clipped."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.precision.unscale_(self.optimizer)
        if inspect is not None:
            inspect(self.model.module)
        grad_norm = self.model.clip_grad_norm_(self.clip)
        # A NaN/Inf gradient norm (the same on every rank) skips the update, on the device.
        self.precision.step(self.optimizer, finite=torch.isfinite(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def discard_gradients(self) -> None:
        """Drop the partial gradients of a failed attempt (and, on a GPU, the cached blocks)."""
        self.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
