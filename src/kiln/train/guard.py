"""Guarding a run against non-finite steps and loss spikes.

A step whose gradient norm is NaN or Inf is skipped on the device: the fused AdamW kernel leaves
parameters and optimizer state untouched when told an infinity was found (GradScaler's
mechanism, used here without a scale), so the loop never waits for the host to decide. The
per-step losses and norms are read at each log point (the loop's one host sync), where the guard
counts bad steps, names the first module whose output is non-finite (by re-running the bad
step's batch with forward hooks), decides on a rollback, and looks for loss spikes.

``Guard`` decides on a rollback and carries it out through the run's checkpointer, keeps the
lowered learning rate and the counts across resumes, and logs what it found.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.config import GuardConfig
from kiln.data.loader import StepBatches


class TrainingDiverged(RuntimeError):  # noqa: N818
    """Non-finite steps kept coming back after the allowed rollbacks; the message is the report."""


@dataclass
class StepReview:
    """What the guard concluded at a log point."""

    bad_steps: list[int] = field(default_factory=list)
    rollback: bool = False
    spikes: list[tuple[int, float]] = field(default_factory=list)


class Guard:
    """``scaler_skips``: fp16's loss scale skips steps whose gradients overflow, routinely while
    it looks for its value; those are its business, and only a non-finite loss counts here."""

    def __init__(self, cfg: GuardConfig, *, scaler_skips: bool = False):
        self.cfg = cfg
        self.scaler_skips = scaler_skips
        self.bad_streak = 0  # non-finite steps in a row, up to the last reviewed step
        self.bad_total = 0
        self.rollbacks = 0
        self.lr_scale = 1.0
        # Running loss statistics (exponential moving averages); the variance is read once the mean is set.
        self._mean: float | None = None
        self._var = 0.0
        self._seen = 0

    # -- state that must survive a resume --------------------------------------------------

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "rollbacks": self.rollbacks, "bad_total": self.bad_total}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.lr_scale, self.rollbacks, self.bad_total = state["lr_scale"], state["rollbacks"], state["bad_total"]

    # -- at each log point ------------------------------------------------------------------

    def review(self, first_step: int, losses: list[float], grad_norms: list[float]) -> StepReview:
        """Per-step values of steps ``first_step``, ``first_step + 1``, ... (1-based)."""
        review = StepReview()
        for i, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True)):
            step = first_step + i
            if math.isfinite(loss) and (math.isfinite(norm) or self.scaler_skips):
                self.bad_streak = 0
                if self._is_spike(loss):
                    review.spikes.append((step, loss))
                continue
            review.bad_steps.append(step)
            self.bad_total += 1
            self.bad_streak += 1
            if self.cfg.max_bad_steps and self.bad_streak >= self.cfg.max_bad_steps:
                review.rollback = True
        return review

    def _is_spike(self, loss: float) -> bool:
        """Far above the running statistics; they skip the first steps, where loss falls fast."""
        warmup = 20
        spike = (
            self.cfg.spike_threshold > 0
            and self._seen >= warmup
            and self._mean is not None  # set from the first step on
            and loss > self._mean + self.cfg.spike_threshold * math.sqrt(self._var) + 1e-6
        )
        if not spike:  # a spike would drag the statistics towards itself
            alpha = 0.1 if self._seen >= warmup else 1.0 / (self._seen + 1)
            if self._mean is None:
                self._mean, self._var = loss, 0.0
            else:
                delta = loss - self._mean
                self._mean += alpha * delta
                self._var = (1 - alpha) * (self._var + alpha * delta * delta)
            self._seen += 1
        return spike

    def metrics(self) -> dict[str, int]:
        """What the logged record says of the guard: the non-finite steps so far, once there are any."""
        return {"nonfinite_steps": self.bad_total} if self.bad_total else {}

    def report(
        self, review: StepReview, logger: Any, batches: StepBatches, locate: Callable[[int], str | None] | None
    ) -> None:
        """Log the review's bad steps (with the first non-finite module, found by ``locate(step)``;
        None where no process can run the whole model to look) and loss spikes (with the batch,
        from the data order) as events."""
        if review.bad_steps:
            step = review.bad_steps[0]
            module = None if locate is None else locate(step)
            if locate is None:
                where = "the module was not looked for (under pipeline parallelism no process holds the whole model)"
            elif module:
                where = f"the first non-finite output is module '{module}'"
            else:
                where = (
                    "every module output was finite when the step's batch was run again (the loss or the backward "
                    "pass went non-finite)"
                )
            logger.event(
                step,
                "non_finite",
                f"non-finite loss or gradient at step(s) "
                f"{', '.join(map(str, review.bad_steps))}: update skipped; {where}",
                steps=review.bad_steps,
                module=module,
            )
        for step, loss in review.spikes:
            logger.event(
                step,
                "loss_spike",
                f"loss spike at step {step}: {loss:.4g}, far above its running mean; batch = {batches.describe(step)}",
                loss=loss,
                batch=batches.positions(step),
            )

    def start_rollback(self) -> None:
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingDiverged(
                f"{self.cfg.max_bad_steps} non-finite steps in a row again after {self.rollbacks} rollback(s) "
                f"(learning rate now x{self.lr_scale:g})."
            )
        self.rollbacks += 1
        self.lr_scale *= self.cfg.lr_factor
        self.bad_streak = 0

    def roll_back(self, step: int, checkpointer: Any, faults: Any, logger: Any) -> int:
        """Back from ``step`` to the newest checkpoint with a lower learning rate, or stop the
        run with a report; the step the run goes on from."""
        path = checkpointer.latest()
        self.roll_back_from(step, has_checkpoint=path is not None)
        mine = self.state_dict()
        restored = checkpointer.load(path)
        self.load_state_dict(mine)  # the lowered rate and the rollback count are newer than the checkpoint
        faults.rolled_back(step)
        logger.rewind(restored)
        logger.event(
            restored,
            "rollback",
            f"{self.cfg.max_bad_steps} non-finite steps in a row by step {step}: "
            f"rolled back to {path.name}, learning rate x{self.lr_scale:g} from now on",
            checkpoint=str(path),
            lr_scale=self.lr_scale,
        )
        return restored

    def roll_back_from(self, bad_step: int, has_checkpoint: bool) -> None:
        """Lower the learning rate for a rollback from ``bad_step``, or stop the run with a report."""
        try:
            if not has_checkpoint:
                raise TrainingDiverged(
                    f"{self.cfg.max_bad_steps} non-finite steps in a row by step {bad_step}, "
                    "and no checkpoint to roll back to yet."
                )
            self.start_rollback()
        except TrainingDiverged as e:
            raise TrainingDiverged(
                f"{e} Stopped at step {bad_step}. Lower train.lr, use bf16 rather than fp16, check "
                "the data (kiln doctor), or raise guard.max_bad_steps."
            ) from None


def first_non_finite_module(model: nn.Module, run: Callable[[], Any]) -> str | None:
    """Run ``run()`` (a forward pass of ``model``) and name the first module, in the order they
    ran, whose output holds a NaN or Inf; None if every output is finite. A module with a
    ``non_finite_parts(inputs, output)`` method names its parts too, as a mixture of experts
    names its experts: "blocks.2.mlp.experts (expert 5)"."""
    found: list[str] = []

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def check(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if found:
                return
            tensors = (
                [output]
                if isinstance(output, torch.Tensor)
                else [t for t in (output if isinstance(output, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
            )
            if any(t.is_floating_point() and not torch.isfinite(t).all() for t in tensors):
                # A module that computes in parts names the parts whose rows went non-finite.
                parts = getattr(module, "non_finite_parts", None)
                which = parts(inputs, output) if parts is not None else None
                found.append((name or type(module).__name__) + (f" ({which})" if which else ""))

        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
