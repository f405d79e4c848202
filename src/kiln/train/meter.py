"""The loop's metrics: each step's loss and gradient norm stay on the device until a log point,
where the interval is read in one go (the loop's one host sync) and turned into the logged
record: loss, learning rate, gradient norm, throughput, MFU, batch sizes, memory."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from kiln.data.batch import RowBatch, batch_rows
from kiln.data.batch_schedule import BatchSchedule
from kiln.device import peak_flops
from kiln.distributed.world import World
from kiln.observe.memory import memory_stats


class StepMeter:
    """``tokens_per_sample`` turns the rows of plain batches into tokens (a ``RowBatch`` counts
    its real, unpadded tokens itself); ``flops_per_token`` gives MFU where the device's peak is
    known. The tokens trained on so far are its state, saved with checkpoints."""

    _settled: dict[str, Any]  # set by start

    def __init__(
        self,
        world: World,
        every: int,
        schedule: BatchSchedule,
        *,
        tokens_per_sample: int,
        flops_per_token: float | None,
    ):
        self.world, self.every, self.schedule = world, every, schedule
        self.tokens_per_sample, self.flops_per_token = tokens_per_sample, flops_per_token
        self.tokens_seen = 0  # over all ranks, up to the last log point
        self.start()

    def state_dict(self) -> dict:
        """The tokens so far and the interval not yet logged, so that a resumed run logs what the
        uninterrupted run would have. Reading the interval is a host sync and, with several
        ranks, a collective: every rank saves checkpoints at the same steps."""
        self._settle()
        return {"tokens_seen": self.tokens_seen, "interval": dict(self._settled, seconds=self._seconds())}

    def load_state_dict(self, state: dict) -> None:
        self.tokens_seen = state["tokens_seen"]
        self.start()
        if "interval" in state:
            interval = state["interval"]
            self._settled = {k: interval[k] for k in ("losses", "grad_norms", "tokens")}
            self._earlier_s = interval["seconds"]

    def start(self) -> None:
        """Begin an interval: no steps yet, the clock from now."""
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []
        self.tokens = 0  # this rank's, in the interval
        # Steps of the interval already read from the device (at a checkpoint, or before a resume).
        self._settled = {"losses": [], "grad_norms": [], "tokens": 0}
        self._earlier_s = 0.0  # of the interval, in a process before a resume
        self.start_clock()

    def start_clock(self) -> None:
        """Time the interval from now (after work before the loop that is not training)."""
        self._t0 = time.perf_counter()
        self._paused_s = 0.0

    def due(self, step: int, now: bool = False) -> bool:
        """Is ``step`` (just done) a log point? ``now``: the run ends or stops here."""
        return now or step % self.every == 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is not training throughput (evaluation, saving): the clock stops."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t0

    def end_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, batch: Any) -> None:
        self.losses.append(loss)
        # On the loss's device: with parameters offloaded to the CPU the norm is computed there.
        self.grad_norms.append(grad_norm.detach().float().to(loss.device))
        rows = batch_rows(batch)
        self.tokens += batch.tokens if isinstance(batch, RowBatch) else rows * self.tokens_per_sample

    def flush(self) -> dict[str, Any]:
        """Per-step losses (averaged over ranks) and gradient norms of the interval, read in one go;
        a new interval starts."""
        self._settle()
        values = dict(self._settled, seconds=self._seconds())
        self.start()
        return values

    def _settle(self) -> None:
        """Read the steps still on the device into the interval's host values."""
        if self.losses:
            per_step = torch.stack([self.world.mean(torch.stack(self.losses)).float(), torch.stack(self.grad_norms)])
            losses, grad_norms = per_step.tolist()
            self._settled["losses"] += losses
            self._settled["grad_norms"] += grad_norms
        self._settled["tokens"] += self.world.dp_total(self.tokens)
        self.losses, self.grad_norms, self.tokens = [], [], 0

    def _seconds(self) -> float:
        return max(1e-9, self._earlier_s + time.perf_counter() - self._t0 - self._paused_s)

    def record(
        self, values: dict[str, Any], *, step: int, lr: float, elapsed_s: float, micro_batch_size: int
    ) -> dict[str, Any]:
        """The logged record of an interval ending at ``step``: means over its finite steps."""
        finite = [
            (step_loss, step_norm)
            for step_loss, step_norm in zip(values["losses"], values["grad_norms"], strict=True)
            if math.isfinite(step_loss) and math.isfinite(step_norm)
        ]
        loss, grad_norm = (sum(v) / len(finite) for v in zip(*finite, strict=True)) if finite else (math.nan, math.nan)
        tokens_per_s = values["tokens"] / values["seconds"]
        self.tokens_seen += values["tokens"]
        record = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "elapsed_s": elapsed_s,
            "global_batch": self.schedule.batch_size(step - 1),
            "micro_batch_size": micro_batch_size,
            "tokens": self.tokens_seen,
        }
        peak = peak_flops(self.world.device)
        if peak and self.flops_per_token:
            record["mfu"] = self.flops_per_token * tokens_per_s / (peak * self.world.size)
        record.update(memory_stats(self.world.device))
        return record
