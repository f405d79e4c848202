"""The training loop. It trains any ``nn.Module`` given a dataset and a loss; the built-in jobs
(``kiln.train.lm``) are users of it.

Read ``Trainer.fit`` top to bottom: resume, then for each step compute the gradients of the
step's batch, update, and at intervals log, evaluate and checkpoint. Each feature is a component
that owns its state and decides its own timing, and the loop calls it the same way in every
configuration: the step (``TrainStep``: precision, accumulation, clipping), the memory ladder
(the micro-batch, and a retry one rung down when the device runs out of memory), the guard
(non-finite steps and loss spikes), the meter (metrics), the checkpointer, the time plan (the
steps that fill a time budget), the profiler, the stragglers (the slow rank, at log points) and
the world's hang watchdog (told which phase of the step each rank is in).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from kiln.config import Config, ConfigError, validate
from kiln.data.batch import split_batch, to_device
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.loader import StepBatches
from kiln.device import resolve_precision
from kiln.distributed.parallelize import parallelize
from kiln.distributed.pipeline import Pipeline
from kiln.distributed.world import World, init_world
from kiln.io import directory_problem
from kiln.models.family import ParallelPlan
from kiln.observe import MetricsLogger, NullLogger
from kiln.observe.profiler import StepProfiler
from kiln.train.apply import apply_compile
from kiln.train.checkpointer import Checkpointer
from kiln.train.faults import Faults
from kiln.train.guard import Guard, first_non_finite_module
from kiln.train.memory_ladder import MemoryLadder, Rung
from kiln.train.meter import StepMeter
from kiln.train.optim import build_optimizer, lr_at
from kiln.train.precision import Precision
from kiln.train.run import Budget, StopRequest, write_run_files
from kiln.train.step import LossFn, TrainStep
from kiln.train.straggler import Stragglers
from kiln.train.time_plan import WARMUP_STEPS, Costs, TimePlan


@dataclass
class FitResult:
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    resumed_from: int | None = None
    interrupted: bool = False
    out_of_time: bool = False


class Trainer:
    """Train ``model`` on ``train_data`` by minimising ``loss_fn(model, batch)``.

    ``loss_fn`` returns the mean loss of one micro-batch. ``eval_fn(model)`` returns a dict of
    validation metrics; ``sample_fn(model, step)`` returns text to show (e.g. a generated
    sample). Both run in eval mode under no_grad and the run's precision. ``tokens_per_sample``
    turns samples/s into tokens/s; ``flops_per_token`` enables MFU where the device's peak is
    known. ``plan`` says how parallelism and activation checkpointing apply to the model (a
    model family's; by default its ``blocks``, and no tensor parallelism). ``collate_fn`` makes a
    batch of dataset items (default: ``default_collate``; a ``TokenBatch`` for variable-length
    rows, whose micro-batches are then weighed by their loss tokens). ``faults`` injects test
    faults (by default those the environment asks for, see ``kiln.train.faults``).
    ``on_evaluate(step, metrics)`` is called on rank 0 after each evaluation (e.g. to report it
    to a hyperparameter search); returning True stops the run there, on every rank, with a
    checkpoint, as a stop signal does (ignored at the last evaluation).

    Under ``torchrun`` it joins the process group and applies ``cfg.parallel`` (DDP, FSDP2,
    tensor parallel) to the model; only rank 0 prints and writes logs.
    """

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset,
        loss_fn: LossFn,
        config: Config | None = None,
        *,
        eval_fn: Callable[[nn.Module], dict[str, float]] | None = None,
        sample_fn: Callable[[nn.Module, int], str] | None = None,
        tokens_per_sample: int = 1,
        flops_per_token: float | None = None,
        plan: ParallelPlan | None = None,
        collate_fn: Callable[[list], Any] = default_collate,
        faults: Faults | None = None,
        console: bool = True,
        on_evaluate: Callable[[int, dict[str, Any]], bool] | None = None,
    ):
        cfg = config or Config()
        validate(cfg)  # a Config built in Python has not been through load_config
        if problem := directory_problem(cfg.run.dir):
            raise ConfigError([f"run.dir: {problem}"])
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.world: World = init_world(cfg.run.device, cfg.parallel, cfg.run.dir)
        self.watchdog = self.world.watchdog  # told where the loop is, to name a hung rank
        self.device = self.world.device
        # The run's config is the resolved one: it is what config.toml and checkpoints record.
        self.cfg = cfg = resolve_precision(cfg, self.device)
        t = cfg.train
        self.console = console and self.world.is_main
        self.run_dir = Path(cfg.run.dir)
        self.eval_fn, self.sample_fn, self.on_evaluate = eval_fn, sample_fn, on_evaluate
        schedule = BatchSchedule.from_config(t, tokens_per_sample)
        self.batches = StepBatches(
            train_data,
            schedule,
            t.seed,
            num_workers=cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
            # Ranks of one tensor-parallel group share a data-parallel rank, so the same batch.
            rank=self.world.dp_rank,
            world_size=self.world.dp,
            collate_fn=collate_fn,
        )
        self.ladder = MemoryLadder(cfg, self.world, schedule, self.run_dir, self._say)
        self.guard = Guard(cfg.guard, scaler_skips=t.precision == "fp16")
        self.faults = faults or Faults.from_env()
        self.faults.attach(model)
        plan = plan or ParallelPlan.infer(model)
        # Evaluation calls the model itself, not a DDP wrapper (whose forward prepares a
        # gradient reduction); under FSDP the two are the same object. A pipeline rank holds
        # some of the layers (``part``), and evaluation runs through every stage.
        self.unwrapped = model.to(self.device)
        pcfg = dataclasses.replace(cfg.parallel, cpu_offload=self.ladder.rung.cpu_offload)
        bf16 = t.precision == "bf16"
        self.pipeline = (
            Pipeline(model, plan, self.world, pcfg, bf16=bf16, compile=t.compile) if self.world.pp > 1 else None
        )
        if self.pipeline is not None:
            self.model = self.unwrapped = self.pipeline.part
        else:
            self.model = parallelize(model, plan, self.world, pcfg, bf16=bf16)
        self.optimizer = build_optimizer(self.model, t, self.device)
        self.precision = Precision(t.precision, self.device)
        # Compiling the loss function compiles the model's forward with it, so the compiler can
        # fuse the output projection with the cross-entropy; the model itself stays plain, and
        # its state dict keeps its own names.
        self.stragglers = Stragglers(self.world, cfg.observe)
        self.train_step = TrainStep(
            self.model,
            apply_compile(loss_fn) if t.compile else loss_fn,
            self.optimizer,
            self.precision,
            grad_clip=t.grad_clip,
            plain=self.unwrapped,
            plan=plan,
            faults=self.faults,
            dp_total=self.world.dp_total,
            dp=self.world.dp,
            pipeline=self.pipeline,
            busy=self.stragglers.clock,
        )
        self.params = self.train_step.params
        self.ladder.bind(self.train_step)
        self.meter = StepMeter(
            self.world, t.log_every, schedule, tokens_per_sample=tokens_per_sample, flops_per_token=flops_per_token
        )
        self.time_plan = TimePlan(cfg)
        self.checkpointer = Checkpointer(
            cfg,
            self.world,
            self.model,
            self.optimizer,
            {
                "precision": self.precision,
                "memory": self.ladder,
                "guard": self.guard,
                "meter": self.meter,
                "time_plan": self.time_plan,
            },
            self.batches,
            self._say,
            faults=self.faults,
        )
        profile_dir = Path(cfg.profile.dir) if cfg.profile.dir else self.run_dir / "profile"
        if self.world.distributed:
            profile_dir = profile_dir / f"rank-{self.world.rank}"
        self.profiler = StepProfiler(cfg.profile.steps, profile_dir, self.device, console=self.console)
        self.step = 0

    @property
    def rung(self) -> Rung:
        return self.ladder.rung

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward pass now (the config's, or where the memory ladder took it)."""
        return self.ladder.micro_batch_size

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> FitResult:
        clock = Budget(self.time_plan.stop_s)
        resumed_from = self.checkpointer.resume()
        self.step = resumed_from or 0
        result = FitResult(step=self.step, resumed_from=resumed_from)
        logger = self._logger()
        self.watchdog.beat(self.step, "setting up the loop (probes, run files)")
        with logger, StopRequest() as stop, self.checkpointer.finishing(), self.watchdog.watching(self.run_dir):
            if self.ladder.probe_needed:
                self.ladder.find_micro_batch(self.batches, self.step, logger)
            if self.time_plan.needs_probe:  # only the process that plans corrects its plan later
                self._plan_steps(logger, clock)
            self._set_max_steps(self.time_plan.max_steps, logger)
            cfg, t = self.cfg, self.cfg.train
            write_run_files(self.run_dir, cfg, self.world, self.model)
            if self.step >= t.max_steps:
                self._say(f"kiln: already trained to step {self.step} (train.max_steps={t.max_steps}); nothing to do")
                return result
            batches = self.batches.loader(self.step)
            self.meter.start_clock()
            loop_started = (self.step, clock.elapsed())
            while self.step < t.max_steps:
                clock.step_started()
                self.profiler.step_begins(self.step + 1)
                lr = lr_at(self.step, t) * self.guard.lr_scale
                self.watchdog.beat(self.step, "loading the batch")
                with self.profiler.region("kiln/data"), self.stragglers.clock.host():
                    # This rank's share of the step's global batch, kept until the step is done
                    # so that a retry after running out of memory sees the same sequences.
                    batch = to_device(next(batches), self.device)
                self.watchdog.beat(self.step, "forward/backward (gradient reduction)")
                with self.profiler.region("kiln/forward_backward"):
                    loss = self.ladder.forward_backward(batch, self.step + 1, logger, save=self.save)
                self.watchdog.beat(self.step, "optimizer step (gradient-norm reduction)")
                with self.profiler.region("kiln/optimizer"):
                    grad_norm = self.train_step.update(lr, inspect=self._histograms(logger))
                self.step += 1
                self.meter.end_step(loss, grad_norm, batch)
                logger.step_done(self.step)
                self.profiler.step_ends(self.step)
                if self.step == self.time_plan.correct_at:
                    self._correct_plan(logger, clock, loop_started)
                    t = self.cfg.train
                # The run ends at max_steps, or early when the next step would overrun the time
                # budget; either way it ends with an evaluation and a checkpoint. Ranks decide
                # together, or one would wait forever in a collective the others skipped.
                self.watchdog.beat(self.step, "step end (ranks agree to go on)")
                out_of_time, stop.requested = self.world.agree(clock.next_step_overruns(), stop.requested)
                final = self.step == t.max_steps or out_of_time
                if self.meter.due(self.step, final or stop.requested):
                    result.metrics, rollback = self._log(logger, lr, clock.elapsed())
                    if rollback:  # the meter, its clock too, is restored with the checkpoint
                        self._roll_back(logger)
                        batches = self.batches.loader(self.step)
                        continue
                # Evaluation and saving are not training throughput: the meter's clock stops.
                self.watchdog.beat(self.step, "evaluation or checkpoint", patient=True)
                with self.meter.paused():
                    if final or (cfg.eval.every and self.step % cfg.eval.every == 0):
                        metrics = self._evaluate(logger)
                        result.eval_metrics = metrics or result.eval_metrics
                        if self._halt_after(metrics) and not final:
                            stop.requested = True  # set, never cleared: a signal may have set it meanwhile
                    if self.checkpointer.due(self.step, final or stop.requested):
                        self.save()
                if out_of_time and self.step < t.max_steps:
                    result.out_of_time = True
                    self._say(
                        f"kiln: time budget {t.time_budget} reached at step {self.step}/{t.max_steps}; "
                        "run the same command again to continue"
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

    def _plan_steps(self, logger, clock: Budget) -> None:
        """``max_steps = "auto"``: time a checkpoint, training steps and an evaluation of this
        very run, put the run back exactly as it was, and plan the steps that fill the budget."""
        self._say("kiln: timing a checkpoint, a few steps and an evaluation to plan train.max_steps=auto ...")
        held = self.checkpointer.hold()
        resumed_at = self.checkpointer.latest()
        save_s = self._warm_seconds(self.save)
        path = self.checkpointer.latest()
        started = time.perf_counter()
        batches = self.batches.loader(self.step)
        start_s, timed_from, steps = 0.0, None, 0
        for i in itertools.count():
            batch = to_device(next(batches), self.device)
            start_s = start_s or time.perf_counter() - started
            self.ladder.forward_backward(batch, self.step + i + 1, logger, save=self.save)
            self.train_step.update(0.0)  # whatever it changes is put back below
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            if timed_from is not None:
                steps += 1
            elif i + 1 >= WARMUP_STEPS and now - started >= self.time_plan.warmup_seconds():
                timed_from = now  # warm: the compile, the allocator's growth and the caches are behind
            # Every rank runs the same number of probe steps, or one would wait in a collective.
            (done,) = self.world.agree(steps >= 3 and now - timed_from >= self.time_plan.probe_seconds())
            if done:
                break
        del batches  # its workers stop
        step_s = (now - timed_from) / steps
        eval_s = self._warm_seconds(lambda: self._evaluate(NullLogger()))
        self.checkpointer.put_back(held)
        if path != resumed_at:
            self.checkpointer.discard(path)
        # Every rank plans with the slowest rank's costs, so that all agree on the steps.
        costs = Costs(*self.world.largest(step_s, eval_s, save_s, start_s))
        self.time_plan.fix(costs, clock.elapsed())
        logger.event(
            self.step, "time_plan", self.time_plan.describe(), max_steps=self.time_plan.max_steps, **vars(costs)
        )

    def _correct_plan(self, logger, clock: Budget, loop_started: tuple[int, float]) -> None:
        """Plan again with the pace this run has kept so far (see TimePlan: at 1/2 and 3/4 of the run)."""
        plan, cfg = self.time_plan, self.cfg
        first_step, first_s = loop_started
        done = self.step - first_step
        evals = done // cfg.eval.every if cfg.eval.every else 0
        saves = done // cfg.checkpoint.every if cfg.checkpoint.every else 0
        spent = clock.elapsed() - first_s - evals * plan.costs.eval_s - saves * plan.costs.save_s
        # The slowest rank's pace and clock, so that every rank plans the same steps.
        step_s, elapsed = self.world.largest(max(spent, 0.0) / done, clock.elapsed())
        before = plan.max_steps
        steps = plan.correct(self.step, step_s, elapsed)
        self._set_max_steps(steps, logger)
        write_run_files(self.run_dir, self.cfg, self.world, self.model)
        logger.event(
            self.step,
            "time_replan",
            f"corrected the plan at step {self.step}: {before} -> {steps} steps "
            f"(a step took {step_s:.3g}s, {plan.costs.step_s:.3g}s in the probe)",
            max_steps=steps,
            step_s=step_s,
        )

    def _warm_seconds(self, work: Callable[[], Any]) -> float:
        """How long ``work`` takes once warm: the first call also pays for imports and first
        allocations, so one that is cheap next to the budget is timed a second time. The slowest
        rank's time decides, so that every rank runs ``work`` (and its collectives) as often."""
        started = time.perf_counter()
        work()
        (seconds,) = self.world.largest(time.perf_counter() - started)
        if seconds > 0.005 * self.time_plan.budget_s:
            return seconds
        started = time.perf_counter()
        work()
        return time.perf_counter() - started

    def _set_max_steps(self, steps: int, logger) -> None:
        """The run's config with the steps it trains for (those planned for "auto")."""
        if steps == self.cfg.train.max_steps:
            return
        self.cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, max_steps=steps))
        self.checkpointer.cfg = self.cfg
        logger.total_steps = steps

    def _logger(self) -> MetricsLogger | NullLogger:
        if not self.world.is_main:
            return NullLogger()
        o = self.cfg.observe
        return MetricsLogger(
            self.run_dir,
            total_steps=self.time_plan.max_steps or 0,
            start_step=self.step,
            console=self.console,
            wandb_project=o.wandb_project if o.wandb else None,
            config=self.cfg.to_dict(),
        )

    def _histograms(self, logger) -> Callable[[nn.Module], None] | None:
        """Weight and gradient histograms of this step, when they are due."""
        every = self.cfg.observe.histograms_every
        if not every or (self.step + 1) % every:
            return None
        step = self.step + 1
        return lambda model: logger.histograms(step, model)

    def _log(self, logger, lr: float, elapsed_s: float) -> tuple[dict[str, float], bool]:
        """Log the interval ending now; whether the guard calls for a rollback."""
        self.watchdog.beat(self.step, "log point (metrics gathered)")
        values = self.meter.flush()  # the one host sync of the interval
        review = self.guard.review(self.step - len(values["losses"]) + 1, values["losses"], values["grad_norms"])
        # A pipeline's ranks cannot run the model alone to look for the module.
        locate = self._locate_non_finite if self.pipeline is None else None
        self.guard.report(review, logger, self.batches, locate)
        record = self.meter.record(
            values, step=self.step, lr=lr, elapsed_s=elapsed_s, micro_batch_size=self.micro_batch_size
        )
        record.update(self.precision.metrics())
        record.update(self.guard.metrics())
        logger.log(self.step, record)
        self.stragglers.review(self.step, len(values["losses"]), logger)
        return record, review.rollback

    def _locate_non_finite(self, step: int) -> str | None:
        """The first module whose output is non-finite when ``step``'s batch runs again."""
        batch = self.batches.batch(step, self.device)
        return first_non_finite_module(
            self.unwrapped,
            lambda: [self.train_step.loss(micro, step) for micro in split_batch(batch, self.micro_batch_size)],
        )

    def _roll_back(self, logger) -> None:
        """Back to the newest checkpoint with a lower learning rate, or stop with a report."""
        bad, path = self.step, self.checkpointer.latest()
        self.guard.roll_back_from(bad, has_checkpoint=path is not None)
        guard = self.guard.state_dict()
        self.step = self.checkpointer.load(path)
        self.guard.load_state_dict(guard)  # the lowered rate and the rollback count are newer than the checkpoint
        self.faults.rolled_back(bad)
        logger.rewind(self.step)
        logger.event(
            self.step,
            "rollback",
            f"{self.cfg.guard.max_bad_steps} non-finite steps in a row by step {bad}: "
            f"rolled back to {path.name}, learning rate x{self.guard.lr_scale:g} from now on",
            checkpoint=str(path),
            lr_scale=self.guard.lr_scale,
        )

    def _evaluate(self, logger) -> dict[str, float] | None:
        if self.eval_fn is None and self.sample_fn is None:
            return None
        was_training = self.model.training
        self.model.eval()
        model = self.pipeline or self.unwrapped
        metrics = None
        try:
            with torch.no_grad(), self.precision.autocast():
                if self.eval_fn is not None:
                    # Scalars as floats; a confusion matrix, say, stays a list (metrics.jsonl only).
                    metrics = {
                        k: v if isinstance(v, (list, dict)) else float(v) for k, v in self.eval_fn(model).items()
                    }
                    logger.log(self.step, metrics)
                # The built-in sampler's KV cache holds every head and layer, which a tensor- or
                # pipeline-parallel rank does not have; samples are skipped there.
                whole = self.world.tp == 1 and self.pipeline is None
                sample = self.sample_fn(model, self.step) if self.sample_fn is not None and whole else None
                if sample is not None:
                    logger.text(self.step, "sample", sample)
        finally:
            self.model.train(was_training)
        return metrics

    def _halt_after(self, metrics: dict[str, Any] | None) -> bool:
        """``on_evaluate``'s answer (rank 0's), the same on every rank."""
        if self.on_evaluate is None or metrics is None:
            return False
        (halt,) = self.world.agree(self.world.is_main and bool(self.on_evaluate(self.step, metrics)))
        return halt

    def _say(self, msg: str) -> None:
        if self.console:
            print(msg, flush=True)
