"""What the loop does after each optimizer step, one component at a time through one interface
(``kiln.train.run.AfterStep``): ``after_step(run)``, where ``run`` (``Progress``) is the run in
progress as they all see it. The log point (``Report``: the interval's metrics, the guard's
review, a rollback) comes first; then, with the meter's clock stopped, evaluation
(``Evaluation``), benchmark tasks (``kiln.train.tasks.TaskScores``) and the checkpoint
(``kiln.train.checkpointer.Checkpointer``). Each decides for itself whether the step is its due."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kiln.data.batch import split_batch
from kiln.data.loader import StepBatches
from kiln.distributed.parallel import ParallelModel
from kiln.distributed.world import World
from kiln.train.checkpointer import Checkpointer
from kiln.train.guard import Guard, first_non_finite_module
from kiln.train.jobs import EvalContext, Job
from kiln.train.meter import StepMeter
from kiln.train.precision import Precision
from kiln.train.routing import ExpertLoad
from kiln.train.run import Progress
from kiln.train.sources import SourceUse
from kiln.train.step import TrainStep
from kiln.train.straggler import Stragglers

# ``on_evaluate(step, metrics, max_steps)``, on rank 0 after each evaluation: True stops the run.
OnEvaluate = Callable[[int, dict[str, Any], int], bool]


class Report:
    """The log point: the interval's per-step losses and gradient norms read in one go (the loop's
    one host sync), the guard's review of them (events for non-finite steps and spikes, a rollback
    to the last checkpoint where it calls for one), and the record logged, with each part's
    metrics; the stragglers' review."""

    phase = "log"

    def __init__(
        self,
        world: World,
        job: Job,
        model: ParallelModel,
        train_step: TrainStep,
        meter: StepMeter,
        guard: Guard,
        parts: tuple[Precision, ExpertLoad, SourceUse, Stragglers],
        batches: StepBatches,
        checkpointer: Checkpointer,
    ):
        self.world, self.job, self.model, self.train_step = world, job, model, train_step
        self.meter, self.guard, (self.precision, self.expert_load, self.sources, self.stragglers) = meter, guard, parts
        self.batches, self.checkpointer = batches, checkpointer

    def after_step(self, run: Progress) -> None:
        if not self.meter.due(run.step, run.final or run.stop.requested):
            return
        values = self.meter.flush()
        review = self.guard.review(run.step - len(values["losses"]) + 1, values["losses"], values["grad_norms"])
        locate = None
        if self.model.whole is not None:  # no rank runs the whole model where it is cut into stages
            locate = functools.partial(self._locate_non_finite, micro_batch_size=run.micro_batch_size)
        self.guard.report(review, run.logger, self.batches, locate)
        record = self.meter.record(
            values, step=run.step, lr=run.lr, elapsed_s=run.clock.elapsed(), micro_batch_size=run.micro_batch_size
        )
        record.update(self.precision.metrics() | self.guard.metrics() | self.expert_load.metrics())
        record.update(self.sources.metrics(run.step, run.logger) | self.job.metrics(self.world))
        run.logger.log(run.step, record)
        self.stragglers.review(run.step, len(values["losses"]), run.logger)
        run.result.metrics = record
        if review.rollback:  # the meter, its clock too, is restored with the checkpoint
            run.step = self.guard.roll_back(run.step, self.checkpointer, self.train_step.faults, run.logger)
            run.rolled_back = True

    def _locate_non_finite(self, step: int, micro_batch_size: int) -> str | None:
        """The first module whose output is non-finite when ``step``'s batch runs again."""
        with torch.random.fork_rng(devices=[]):  # a job's rollout (GRPO's sampling) draws apart from the run
            batch = self.job.rollout(
                self.model.eval_forward, self.batches.batch(step, self.world.device), micro_batch_size, step
            )
        assert self.model.whole is not None  # only asked where this rank holds the whole model
        replay = split_batch(batch, micro_batch_size)
        return first_non_finite_module(self.model.whole, lambda: self.train_step.replay(replay, step))


class Evaluation:
    """The job's evaluation (and its text sample) every ``eval.every`` steps and at the end, and
    ``on_evaluate``'s answer to it (rank 0's, the same on every rank): True stops the run there,
    with a checkpoint, as a stop signal does."""

    phase = "evaluate"

    def __init__(
        self, job: Job, model: ParallelModel, precision: Precision, world: World, on_evaluate: OnEvaluate | None
    ):
        self.job, self.model, self.precision, self.world, self.on_evaluate = job, model, precision, world, on_evaluate
        self.every = job.cfg.eval.every

    def after_step(self, run: Progress) -> None:
        if not (run.final or (self.every and run.step % self.every == 0)):
            return
        metrics = self.evaluate(run.step, run.micro_batch_size, run.logger)
        run.result.eval_metrics = metrics or run.result.eval_metrics
        if metrics is None or self.on_evaluate is None:
            return
        halt = self.world.is_main and bool(self.on_evaluate(run.step, metrics, run.planned_steps))
        if self.world.agree(halt)[0] and not run.final:  # told of the last evaluation too, which it cannot stop
            run.stop.requested = True

    def evaluate(self, step: int, micro_batch_size: int, logger: Any) -> dict[str, Any] | None:
        """The job's metrics at ``step`` (None: it has none), logged with its sample."""
        module, was_training = self.model.module, self.model.module.training
        module.eval()
        ctx = EvalContext(step, self.world.device, micro_batch_size, self.precision)
        try:
            with torch.no_grad(), self.precision.autocast():
                metrics = self.job.evaluate(self.model.eval_forward, ctx)
                if metrics is not None:
                    # Scalars as floats; a confusion matrix, say, stays a list (metrics.jsonl only).
                    metrics = {k: v if isinstance(v, (list, dict)) else float(v) for k, v in metrics.items()}
                    logger.log(step, metrics)
                if (sample := self.job.sample(self.model.eval_forward, ctx)) is not None:
                    logger.text(step, "sample", sample)
        finally:
            module.train(was_training)
        return metrics
