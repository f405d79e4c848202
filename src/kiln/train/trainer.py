"""The training loop: it trains a job (``kiln.train.jobs``), a built-in one or any ``nn.Module``
given with a dataset and a loss.

Read ``Trainer.fit`` top to bottom: resume, then for each step compute the gradients of the
step's batch, update, and at intervals log, evaluate and checkpoint. Each feature is a component
that owns its state and decides its own timing, called alike in every configuration and layout:
the model (``ParallelModel``: this rank's share), the step (``TrainStep``), the memory ladder
(the micro-batch, and a retry one rung down when memory runs out), the guard (non-finite steps,
spikes), the experts' load (a mixture of experts' balancing), the meter, the checkpointer, the
time plan (the steps that fill a time budget) and the phases (watchdog, profiler, stragglers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.config import Config, ConfigError
from kiln.data.batch import split_batch, to_device
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.loader import StepBatches
from kiln.distributed.world import init_world
from kiln.io import directory_problem
from kiln.observe import NullLogger, open_logger
from kiln.observe.profiler import StepProfiler
from kiln.train.checkpointer import Checkpointer, Stateful
from kiln.train.faults import faults_for
from kiln.train.guard import Guard, first_non_finite_module
from kiln.train.jobs import EvalContext, Job, ModuleJob, job_for, resolve_config
from kiln.train.memory_ladder import MemoryLadder, starting_rung
from kiln.train.meter import StepMeter
from kiln.train.optim import build_optimizer, lr_at
from kiln.train.phases import Phases
from kiln.train.precision import Precision
from kiln.train.routing import ExpertLoad
from kiln.train.run import Budget, FitResult, StopRequest, seed_everything, write_run_files
from kiln.train.setup import SetupTimes, start_model
from kiln.train.sources import SourceUse
from kiln.train.step import LossFn, TrainStep
from kiln.train.straggler import Stragglers
from kiln.train.tasks import TaskScores
from kiln.train.time_plan import TimePlan

# ``on_evaluate(step, metrics, max_steps)``, on rank 0 after each evaluation: True stops the run.
OnEvaluate = Callable[[int, dict[str, Any], int], bool]


class Trainer:
    """Trains a job: ``Trainer(job_for(cfg))`` for a built-in one (``kiln.train.jobs``), or your
    own ``nn.Module`` as ``Trainer(model, train_data, loss_fn, config, eval_fn=..., ...)``, which
    minimises ``loss_fn(model, batch)`` (the mean loss of one micro-batch); the keywords after
    ``config`` are those of ``kiln.train.jobs.ModuleJob`` (evaluation, samples, tokens per sample,
    FLOPs per token, the parallel plan, the collate function). Test faults come from ``[debug]``.

    ``on_evaluate(step, metrics, max_steps)`` is called on rank 0 after each evaluation (e.g. to
    report it to a hyperparameter search); returning True stops the run there, on every rank,
    with a checkpoint, as a stop signal does (ignored at the last evaluation). Under ``torchrun``
    it lays the model out as ``[parallel]`` says (DDP, FSDP2, TP, PP); only rank 0 prints and logs."""

    def __init__(
        self,
        job: Job | nn.Module,
        train_data: Dataset | None = None,
        loss_fn: LossFn | None = None,
        config: Config | None = None,
        *,
        console: bool = True,
        on_evaluate: OnEvaluate | None = None,
        **module: Any,
    ):
        if not isinstance(job, Job):
            if train_data is None or loss_fn is None:
                raise TypeError("Trainer(model, train_data, loss_fn, config): a model needs its data and loss function")
            job = ModuleJob(resolve_config(config or Config(), job="module"), job, train_data, loss_fn, **module)
        self.job, self.cfg, self.on_evaluate = job, job.cfg, on_evaluate
        cfg, t = self.cfg, self.cfg.train
        # Before the data is prepared, which can take minutes.
        if problem := directory_problem(cfg.run.dir):
            raise ConfigError([f"run.dir: {problem}"])
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.world = world = init_world(cfg.run.device, cfg.parallel, cfg.run.dir)
        self.device, self.console, self.run_dir = world.device, console and world.is_main, Path(cfg.run.dir)
        seed_everything(t.seed)
        job.prepare(world, self.console)
        self.precision = Precision(t.precision, self.device, t.fp8_recipe)
        schedule = BatchSchedule.from_config(t, job.tokens_per_sample, world.data_ranks)
        self.batches = StepBatches(
            job.train_data,
            schedule,
            t.seed,
            num_workers=cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
            # Ranks of one tensor- or context-parallel group read the same batch.
            rank=world.data_rank,
            world_size=world.data_ranks,
            collate_fn=job.collate_fn,
        )
        start = starting_rung(cfg, world, schedule, self.run_dir, self._say)
        self.guard = Guard(cfg.guard, scaler_skips=t.precision == "fp16")
        self.faults = faults_for(cfg.debug, world.rank)
        pcfg = dataclasses.replace(cfg.parallel, cpu_offload=start.rung.cpu_offload)
        self.setup = SetupTimes(self._say)
        self.model = start_model(job, world, pcfg, self.precision, self.faults, self.setup)
        self.optimizer = build_optimizer(self.model, t, self.device)
        self.stragglers, self.tasks = Stragglers(world, cfg.observe), TaskScores(cfg, job)
        self.train_step = TrainStep(
            self.model,
            job.loss_fn,
            self.optimizer,
            self.precision,
            grad_clip=t.grad_clip,
            train=t,
            faults=self.faults,
            busy=self.stragglers.clock,
            say=self._say,
        )
        self.expert_load = ExpertLoad(self.model.module, world)
        self.sources = SourceUse(job.train_data, schedule, cfg.data.max_epochs)
        self.ladder = MemoryLadder(cfg, world, schedule, self.run_dir, self.train_step, start)
        self.meter = StepMeter(
            world, t.log_every, schedule, tokens_per_sample=job.tokens_per_sample, flops_per_token=job.flops_per_token
        )
        self.time_plan = TimePlan(cfg, schedule, job.tokens_per_sample, job.train_data)
        parts: dict[str, Stateful] = {"precision": self.precision, "memory": self.ladder, "guard": self.guard}
        parts.update(meter=self.meter, time_plan=self.time_plan)
        self.checkpointer = Checkpointer(
            cfg, world, self.model, self.optimizer, parts, self.batches, self._say, faults=self.faults
        )
        rank = world.rank if world.distributed else None
        self.profiler = StepProfiler(cfg.profile, self.run_dir, self.device, rank=rank, console=self.console)
        self.phases = Phases(world.watchdog, self.profiler, self.stragglers.clock)
        if world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            job.write_files(self.run_dir)
        self.step = 0

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward pass now (the config's, or where the memory ladder took it)."""
        return self.ladder.micro_batch_size

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> FitResult:
        clock, plan, phase = Budget(self.time_plan.stop_s), self.time_plan, self.phases.phase
        with self.setup.timed("load checkpoint"):
            resumed_from = self.checkpointer.resume()
        self.step = resumed_from or 0
        result = FitResult(step=self.step, resumed_from=resumed_from)
        logger = open_logger(
            self.run_dir,
            self.cfg,
            main=self.world.is_main,
            total_steps=self.time_plan.max_steps or 0,
            start_step=self.step,
            console=self.console,
        )
        with logger, StopRequest() as stop, self.checkpointer.finishing(), self.world.watchdog.watching(self.run_dir):
            with phase("setup", self.step):
                if self.ladder.probe_needed:
                    self.ladder.find_micro_batch(self.batches, self.step, logger)
                if plan.needs_probe:  # only the process that plans corrects its plan later
                    self._plan_steps(logger, clock)
                logger.total_steps = plan.steps
                self._write_run_files()
            if self.step >= plan.steps:
                self._say(f"kiln: already trained to step {self.step} (train.max_steps={plan.steps}); nothing to do")
                return result
            batches = self.batches.loader(self.step)
            self.meter.start_clock()
            plan.loop_starts(self.step, clock.elapsed())
            self.setup.loop_starts()
            while self.step < plan.steps:
                clock.step_started()
                self.profiler.step_begins(self.step + 1)
                lr = lr_at(self.step, self.cfg.train, plan.steps) * self.guard.lr_scale
                with phase("data", self.step):
                    # This rank's share of the batch, kept so that a retry after an OOM sees the same.
                    batch = to_device(next(batches), self.device)
                with phase("rollout", self.step):
                    batch = self.job.rollout(self.model.module, batch, self.micro_batch_size)
                with phase("forward_backward", self.step):
                    loss = self.ladder.forward_backward(batch, self.step + 1, logger, save=self.save)
                with phase("optimizer", self.step):
                    grad_norm = self.train_step.update(lr, inspect=logger.inspector(self.step + 1))
                    self.expert_load.step_done()
                self.step += 1
                self.meter.end_step(loss, grad_norm, batch)
                logger.step_done(self.step)
                self.profiler.step_ends(self.step)
                self.setup.step_done()
                # The run ends at max_steps or before a step that would overrun the budget, evaluated
                # and saved; ranks decide together, or one would wait in a collective the others skip.
                with phase("agree", self.step):
                    flags = clock.next_step_overruns(), stop.requested, plan.due(self.step, clock.elapsed())
                    out_of_time, stop.requested, replan = self.world.agree(*flags)
                if replan:  # with the pace this run has kept (see TimePlan)
                    plan.correct_pace(self.world, self.step, clock.elapsed(), logger)
                    self._write_run_files()
                final = self.step == plan.steps or out_of_time
                if self.meter.due(self.step, final or stop.requested):
                    result.metrics, rollback = self._log(logger, lr, clock.elapsed())
                    if rollback:  # the meter, its clock too, is restored with the checkpoint
                        self.step = self.guard.roll_back(self.step, self.checkpointer, self.faults, logger)
                        batches = self.batches.loader(self.step)
                        continue
                # Evaluation and saving are not training throughput: the meter's clock stops.
                with phase("evaluate_save", self.step), self.meter.paused():
                    if final or (self.cfg.eval.every and self.step % self.cfg.eval.every == 0):
                        metrics = self._evaluate(logger)
                        result.eval_metrics = metrics or result.eval_metrics
                        if self._halt_after(metrics) and not final:
                            stop.requested = True  # set, never cleared: a signal may have set it meanwhile
                    if self.tasks.due(self.step, final):
                        self.tasks.score(
                            self.model.eval_forward, self.step, self.micro_batch_size, logger, self.precision
                        )
                    if self.checkpointer.due(self.step, final or stop.requested):
                        self.save()
                if out_of_time and self.step < plan.steps:
                    result.out_of_time = True
                    self._say(
                        f"kiln: time budget {self.cfg.train.budget} reached at step {self.step}/"
                        f"{plan.steps}; run the same command again to continue"
                    )
                    break
                if stop.requested:
                    result.interrupted = True
                    self._say(f"kiln: stopped at step {self.step}; resume with the same command")
                    break
        result.step = self.step
        return result

    # -- pieces of the loop --------------------------------------------------------------------

    def save(self) -> Path:
        return self.checkpointer.save(self.step)

    def _write_run_files(self) -> None:
        """config.toml as the plan resolved it (steps, batch, micro-batch in use), and the rest."""
        resolved = self.time_plan.resolved(self.cfg, self.micro_batch_size)
        write_run_files(self.run_dir, resolved, self.world, self.model.module)

    def _plan_steps(self, logger: Any, clock: Budget) -> None:
        """``max_steps = "auto"``: the time plan measures this very run, which it then puts back."""
        self._say("kiln: timing a checkpoint, a few steps and an evaluation to plan train.max_steps=auto ...")

        def train(batch: Any, i: int) -> None:
            batch = self.job.rollout(self.model.module, batch, self.micro_batch_size)
            self.ladder.forward_backward(batch, self.step + i + 1, logger, save=self.save)
            self.train_step.update(0.0)

        with self.train_step.hold_compile():
            self.time_plan.measure(
                self.world,
                self.checkpointer,
                batches=lambda: (to_device(b, self.device) for b in self.batches.loader(self.step)),
                train=train,
                evaluate=lambda: self._evaluate(NullLogger()),
                save=self.save,
                device=self.device,
                elapsed=clock.elapsed,
                logger=logger,
                step=self.step,
            )

    def _log(self, logger: Any, lr: float, elapsed_s: float) -> tuple[dict[str, float], bool]:
        """Log the interval ending now; whether the guard calls for a rollback."""
        with self.phases.phase("log", self.step):
            values = self.meter.flush()  # the one host sync of the interval
        review = self.guard.review(self.step - len(values["losses"]) + 1, values["losses"], values["grad_norms"])
        # Where no rank runs the whole model (it is cut into stages), the module is not looked for.
        locate = self._locate_non_finite if self.model.whole is not None else None
        self.guard.report(review, logger, self.batches, locate)
        record = self.meter.record(
            values, step=self.step, lr=lr, elapsed_s=elapsed_s, micro_batch_size=self.micro_batch_size
        )
        record.update(self.precision.metrics() | self.guard.metrics() | self.expert_load.metrics())
        record.update(self.sources.metrics(self.step, logger) | self.job.metrics(self.world))
        logger.log(self.step, record)
        self.stragglers.review(self.step, len(values["losses"]), logger)
        return record, review.rollback

    def _locate_non_finite(self, step: int) -> str | None:
        """The first module whose output is non-finite when ``step``'s batch runs again."""
        with torch.random.fork_rng(devices=[]):  # a job's rollout (GRPO's sampling) draws apart from the run
            batch = self.job.rollout(self.model.module, self.batches.batch(step, self.device), self.micro_batch_size)
        micro_batches = split_batch(batch, self.micro_batch_size)
        assert self.model.whole is not None  # only called where this rank holds the whole model (_log)
        return first_non_finite_module(self.model.whole, lambda: self.train_step.replay(micro_batches, step))

    def _evaluate(self, logger: Any) -> dict[str, Any] | None:
        module, was_training = self.model.module, self.model.module.training
        module.eval()
        ctx = EvalContext(self.step, self.device, self.micro_batch_size, self.precision, self.model.generates)
        try:
            with torch.no_grad(), self.precision.autocast():
                metrics = self.job.evaluate(self.model.eval_forward, ctx)
                if metrics is not None:
                    # Scalars as floats; a confusion matrix, say, stays a list (metrics.jsonl only).
                    metrics = {k: v if isinstance(v, (list, dict)) else float(v) for k, v in metrics.items()}
                    logger.log(self.step, metrics)
                if (sample := self.job.sample(self.model.eval_forward, ctx)) is not None:
                    logger.text(self.step, "sample", sample)
        finally:
            module.train(was_training)
        return metrics

    def _halt_after(self, metrics: dict[str, Any] | None) -> bool:
        """``on_evaluate``'s answer (rank 0's), the same on every rank."""
        if self.on_evaluate is None or metrics is None:
            return False
        halt = self.world.is_main and bool(self.on_evaluate(self.step, metrics, self.time_plan.steps))
        return self.world.agree(halt)[0]

    def _say(self, msg: str) -> None:
        if self.console:
            print(msg, flush=True)


def train(cfg: Config, *, console: bool = True, on_evaluate: OnEvaluate | None = None) -> FitResult:
    """Train the job of ``cfg`` (what ``kiln train`` does)."""
    return Trainer(job_for(cfg), console=console, on_evaluate=on_evaluate).fit()
