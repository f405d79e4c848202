"""The training loop: it trains a job (``kiln.train.jobs``), a built-in one or any ``nn.Module``
given with a dataset and a loss.

Read ``Trainer.fit`` top to bottom: resume; for each step, the batch, its gradients (retried one
rung down the memory ladder when memory runs out), the update, then the components called after
each step (``kiln.train.after_step``: the log point with the guard's review, evaluation, task
scores, the checkpoint), each deciding when it is due. They run alike in every layout: the
model is a ``ParallelModel`` (this rank's share) and ``TrainStep`` its step's arithmetic."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.config import Config, ConfigError
from kiln.data.batch import split_batch, to_device
from kiln.data.batch_schedule import BatchSchedule
from kiln.distributed.world import init_world
from kiln.io import directory_problem
from kiln.observe import NullLogger, open_logger
from kiln.observe.profiler import StepProfiler
from kiln.train.after_step import Evaluation, OnEvaluate, Report
from kiln.train.checkpointer import Checkpointer, Stateful
from kiln.train.faults import faults_for
from kiln.train.guard import Guard
from kiln.train.jobs import Job, ModuleJob, job_for, resolve_config
from kiln.train.memory_ladder import MemoryLadder, starting_rung
from kiln.train.meter import StepMeter
from kiln.train.optim import build_optimizer, lr_at
from kiln.train.phases import Phases
from kiln.train.precision import Precision
from kiln.train.routing import ExpertLoad
from kiln.train.run import AfterStep, Budget, FitResult, Progress, StopRequest, seed_everything, write_run_files
from kiln.train.setup import RunClaim, SetupTimes, start_model, step_batches
from kiln.train.sources import SourceUse
from kiln.train.step import LossFn, TrainStep
from kiln.train.straggler import Stragglers
from kiln.train.tasks import TaskScores
from kiln.train.time_plan import TimePlan


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
        self.job, self.cfg = job, job.cfg
        cfg, t = self.cfg, self.cfg.train
        # Before the data is prepared, which can take minutes.
        if problem := directory_problem(cfg.run.dir):
            raise ConfigError([f"run.dir: {problem}"])
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.world = world = init_world(cfg.run.device, cfg.parallel, cfg.run.dir)
        self.device, self.console, self.run_dir = world.device, console and world.is_main, Path(cfg.run.dir)
        self.claim = RunClaim(self.run_dir, world.is_main)  # taken by fit: the run directory is then its own
        seed_everything(t.seed)
        job.prepare(world, self.console)
        self.precision = Precision(t.precision, self.device, t.fp8_recipe)
        schedule = BatchSchedule.from_config(t, job.tokens_per_sample, world.data_ranks)
        self.batches = step_batches(job, schedule, world)
        start = starting_rung(cfg, world, schedule, self.run_dir, self._say)
        self.guard = Guard(cfg.guard, scaler_skips=t.precision == "fp16")
        self.faults = faults_for(cfg.debug, world.rank)
        pcfg = dataclasses.replace(cfg.parallel, cpu_offload=start.rung.cpu_offload)
        self.setup = SetupTimes(self._say)
        self.model = start_model(job, world, pcfg, self.precision, self.faults, self.setup)
        self.optimizer = build_optimizer(self.model, t, self.device)
        self.stragglers = Stragglers(world, cfg.observe)
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
        self.time_plan = TimePlan(cfg, schedule, job.tokens_per_sample, job.train_data, job.repeat)
        parts: dict[str, Stateful] = {"precision": self.precision, "memory": self.ladder, "guard": self.guard}
        parts.update(meter=self.meter, time_plan=self.time_plan, **job.checkpoint_parts())
        self.checkpointer = Checkpointer(
            cfg, world, self.model, self.optimizer, parts, self.batches, self._say, faults=self.faults
        )
        rank = world.rank if world.distributed else None
        self.profiler = StepProfiler(cfg.profile, self.run_dir, self.device, rank=rank, console=self.console)
        self.phases = Phases(world.watchdog, self.profiler, self.stragglers.clock)
        metered = (self.precision, self.expert_load, self.sources, self.stragglers)
        self.report = Report(
            world, job, self.model, self.train_step, self.meter, self.guard, metered, self.batches, self.checkpointer
        )
        self.evaluation = Evaluation(job, self.model, self.precision, world, on_evaluate)
        tasks = TaskScores(cfg, job, self.model, self.precision)
        self.after_step: list[AfterStep] = [self.evaluation, tasks, self.checkpointer]
        self.step = 0

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward pass now (the config's, or where the memory ladder took it)."""
        return self.ladder.micro_batch_size

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> FitResult:
        plan, phase = self.time_plan, self.phases.phase
        with self.claim, self._resumed() as run:
            if self._before_loop(run):  # already trained that far
                return run.result
            batches = self.batches.loader(self.step)
            self._loop_starts(run)
            while self.step < plan.steps:
                lr = self._step_starts(run)
                with phase("data", self.step):
                    # This rank's share of the batch, kept so that a retry after an OOM sees the same.
                    batch = to_device(next(batches), self.device)
                with phase("rollout", self.step):
                    batch = self.job.rollout(self.model.eval_forward, batch, self.micro_batch_size, self.step + 1)
                with phase("forward_backward", self.step):
                    for attempt in self.ladder.attempts(self.step + 1, run.logger, self.save):  # OOM: a rung down
                        with attempt:
                            micro_batches = split_batch(batch, self.micro_batch_size)
                            loss = self.train_step.forward_backward(micro_batches, self.step + 1)
                with phase("optimizer", self.step):
                    grad_norm = self.train_step.update(lr, inspect=run.logger.inspector(self.step + 1))
                    self.expert_load.step_done()
                self._step_ends(run, loss, grad_norm, batch)
                with phase("log", self.step):
                    self.report.after_step(run)
                if run.rolled_back:  # to the last checkpoint, with a lower learning rate
                    self.step, batches = run.step, self.batches.loader(run.step)
                    continue
                # Evaluation, task scores and checkpoints are not training throughput: the meter's clock stops.
                with self.meter.paused():
                    for part in self.after_step:
                        with phase(part.phase, self.step):
                            part.after_step(run)
                if self._stops(run):
                    break
        run.result.step = self.step
        return run.result

    # -- pieces of the loop --------------------------------------------------------------------

    def save(self) -> Path:
        return self.checkpointer.save(self.step)

    @contextlib.contextmanager
    def _resumed(self) -> Iterator[Progress]:
        """The job's files written into the run directory and the run resumed from its checkpoint
        (per checkpoint.resume); then its logger, its stop request (signals), the checkpointer's
        last write and the hang watchdog, around the loop."""
        if self.world.is_main:
            self.job.write_files(self.run_dir)
        with self.setup.timed("load checkpoint"):
            resumed_from = self.checkpointer.resume()
        self.step = resumed_from or 0
        result = FitResult(step=self.step, resumed_from=resumed_from)
        plan, world = self.time_plan, self.world
        main, steps = world.is_main, plan.max_steps or 0  # "auto": the logger is told the steps once planned
        logger = open_logger(
            self.run_dir, self.cfg, main=main, total_steps=steps, start_step=self.step, console=self.console
        )
        with logger, StopRequest() as stop, self.checkpointer.finishing(), world.watchdog.watching(self.run_dir):
            yield Progress(logger, stop, result, Budget(plan.stop_s), step=self.step)

    def _before_loop(self, run: Progress) -> bool:
        """The micro-batch probe and the time plan's, where the config asks for them; the run files.
        Whether the run has nothing left to do."""
        with self.phases.phase("setup", self.step):
            if self.ladder.probe_needed:
                self.ladder.find_micro_batch(self.batches, self.step, run.logger)
            if self.time_plan.needs_probe:  # only the process that plans corrects its plan later
                self._plan_steps(run)
            run.logger.total_steps = self.time_plan.steps
            self._write_run_files()
        if done := self.step >= (steps := self.time_plan.steps):
            self._say(f"kiln: already trained to step {self.step} (train.max_steps={steps}); nothing to do")
        return done

    def _loop_starts(self, run: Progress) -> None:
        self.meter.start_clock()
        self.time_plan.loop_starts(self.step, run.clock.elapsed())
        self.setup.loop_starts()

    def _step_starts(self, run: Progress) -> float:
        """The step's learning rate."""
        run.clock.step_started()
        self.profiler.step_begins(self.step + 1)
        run.lr = lr_at(self.step, self.cfg.train, self.time_plan.steps) * self.guard.lr_scale
        return run.lr

    def _step_ends(self, run: Progress, loss: torch.Tensor, grad_norm: torch.Tensor, batch: Any) -> None:
        """Count the step; the ranks agree whether the run goes on and whether the time plan
        corrects its length (see TimePlan): ranks decide together, or one would wait in a
        collective the others skip. The run ends at max_steps or before a step that would overrun
        the budget."""
        self.step += 1
        self.meter.end_step(loss, grad_norm, batch)
        run.logger.step_done(self.step)
        self.profiler.step_ends(self.step)
        self.setup.step_done()
        plan, stop, clock = self.time_plan, run.stop, run.clock
        with self.phases.phase("agree", self.step):
            flags = clock.next_step_overruns(), stop.requested, plan.due(self.step, clock.elapsed())
            run.out_of_time, stop.requested, replan = self.world.agree(*flags)
        if replan:  # with the pace this run has kept
            plan.correct_pace(self.world, self.step, clock.elapsed(), run.logger)
            self._write_run_files()
        run.step, run.planned_steps, run.micro_batch_size = self.step, plan.steps, self.micro_batch_size
        run.final, run.rolled_back = self.step == plan.steps or run.out_of_time, False

    def _stops(self, run: Progress) -> bool:
        """Whether the run ends here before its planned steps: out of time, or asked to stop."""
        if run.out_of_time and self.step < self.time_plan.steps:
            run.result.out_of_time = True
            self._say(
                f"kiln: time budget {self.cfg.train.budget} reached at step {self.step}/"
                f"{self.time_plan.steps}; run the same command again to continue"
            )
            return True
        if run.stop.requested:
            run.result.interrupted = True
            self._say(f"kiln: stopped at step {self.step}; resume with the same command")
        return run.stop.requested

    def _write_run_files(self) -> None:
        """config.toml as the plan resolved it (steps, batch, micro-batch in use), and the rest."""
        resolved = self.time_plan.resolved(self.cfg, self.micro_batch_size)
        write_run_files(self.run_dir, resolved, self.world, self.model.module)

    def _plan_steps(self, run: Progress) -> None:
        """``max_steps = "auto"``: the time plan measures this very run, which it then puts back."""
        self._say("kiln: timing a checkpoint, a few steps and an evaluation to plan train.max_steps=auto ...")

        def train(batch: Any, i: int) -> None:
            batch = self.job.rollout(self.model.eval_forward, batch, self.micro_batch_size, self.step + i + 1)
            for attempt in self.ladder.attempts(self.step + i + 1, run.logger, self.save):
                with attempt:
                    self.train_step.forward_backward(split_batch(batch, self.micro_batch_size), self.step + i + 1)
            self.train_step.update(0.0)

        with self.train_step.hold_compile():
            self.time_plan.measure(
                self.world,
                self.checkpointer,
                batches=lambda: (to_device(b, self.device) for b in self.batches.loader(self.step)),
                train=train,
                evaluate=lambda: self.evaluation.evaluate(self.step, self.micro_batch_size, NullLogger()),
                save=self.save,
                device=self.device,
                elapsed=run.clock.elapsed,
                logger=run.logger,
                step=self.step,
            )

    def _say(self, msg: str) -> None:
        if self.console:
            print(msg, flush=True)


def train(cfg: Config, *, console: bool = True, on_evaluate: OnEvaluate | None = None) -> FitResult:
    """Train the job of ``cfg`` (what ``kiln train`` does)."""
    return Trainer(job_for(cfg), console=console, on_evaluate=on_evaluate).fit()
