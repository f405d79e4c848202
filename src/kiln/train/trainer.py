"""The training loop. It trains any ``nn.Module`` given a dataset and a loss; the built-in GPT
job (``kiln.train.lm``) is one user of it.

Read ``Trainer.fit`` top to bottom: restore, then for each step accumulate micro-batches, clip,
step, and at intervals log, evaluate and checkpoint. Every feature is an object the loop calls
the same way in every configuration (precision, schedule, checkpoint store, logger) rather
than a flag checked along the way. The one guard around the step is the out-of-memory ladder
(``kiln.train.oom``): a step that runs out of device memory is retried, from the same data,
with a smaller micro-batch (then activation checkpointing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from kiln.checkpoint import (CheckpointError, capture_rng, latest_checkpoint, list_checkpoints, load_checkpoint,
                             load_sharded, restore_rng, save_checkpoint)
from kiln.config import Config, ConfigError, parse_duration, validate
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.loader import StepSampler, make_train_loader
from kiln.distributed.parallelize import clip_grad_norm_, gradient_sync, is_sharded, parallelize
from kiln.distributed.world import World, init_world
from kiln.observe import MetricsLogger, NullLogger
from kiln.observe.memory import memory_stats
from kiln.observe.profiler import StepProfiler
from kiln.train.apply import apply_activation_checkpointing, apply_compile
from kiln.train.guard import Guard, InjectedNaN, StepReview, TrainingDiverged, first_non_finite_module
from kiln.train.oom import (InjectedOOM, OutOfMemoryExhausted, RestartForRung, Rung, largest_fitting,
                            micro_batch_options, next_rung, read_rung_file, write_rung_file)
from kiln.train.optim import build_optimizer, lr_at
from kiln.train.precision import Precision

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a (nested) batch; non_blocking overlaps the copy from pinned memory with compute."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def collate(dataset: Dataset, indices: Iterable[int], device: torch.device) -> Any:
    """Items ``indices`` of ``dataset`` as one batch on ``device``, outside any DataLoader."""
    return to_device(default_collate([dataset[i] for i in indices]), device)


def split_batch(batch: Any, size: int) -> list[Any]:
    """Cut a (nested) batch into micro-batches of ``size`` rows (views, no copies)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, (list, tuple)):
        return [type(batch)(parts) for parts in zip(*(split_batch(b, size) for b in batch))]
    if isinstance(batch, dict):
        return [dict(zip(batch, parts)) for parts in zip(*(split_batch(v, size) for v in batch.values()))]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches; "
                    "use tensors, or tuples, lists or dicts of them")


def batch_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    return batch_rows(next(iter(batch.values() if isinstance(batch, dict) else batch)))


# Share of device memory the micro-batch probe leaves free, for what a probe does not show
# (allocator fragmentation, evaluation, a longer document mix).
PROBE_MARGIN = 0.10


@dataclass
class FitResult:
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    resumed_from: int | None = None
    interrupted: bool = False
    out_of_time: bool = False


class _StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves and stops at the next step boundary, so a
    checkpoint is never taken from a half-applied optimizer step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nkiln: received signal {signum}; saving a checkpoint at the end of this step "
              "(send it again to stop at once)", flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Train ``model`` on ``train_data`` by minimising ``loss_fn(model, batch)``.

    ``loss_fn`` returns the mean loss of one micro-batch. ``eval_fn(model)`` returns a dict of
    validation metrics; ``sample_fn(model, step)`` returns text to show (e.g. a generated
    sample). Both run in eval mode under no_grad and the run's precision. ``tokens_per_sample``
    turns samples/s into tokens/s; ``flops_per_token`` enables MFU where the device's peak is
    known.

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
        console: bool = True,
    ):
        self.cfg = cfg = config or Config()
        validate(cfg)  # a Config built in Python has not been through load_config
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.world: World = init_world(cfg.run.device, cfg.parallel.tp)
        self.device = self.world.device
        self.console = console and self.world.is_main
        self.run_dir = Path(cfg.run.dir)
        self.schedule = BatchSchedule.from_config(cfg.train, tokens_per_sample)
        self.micro_options = self._micro_batch_options()
        self.rung, self.probe_needed = self._initial_rung()
        self.inject_oom = InjectedOOM()
        self.guard = Guard(cfg.guard, scaler_skips=cfg.train.precision == "fp16")
        profile_dir = Path(cfg.profile.dir) if cfg.profile.dir else self.run_dir / "profile"
        if self.world.distributed:
            profile_dir = profile_dir / f"rank-{self.world.rank}"
        self.profiler = StepProfiler(cfg.profile.steps, profile_dir, self.device, console=self.console)
        self.inject_nan = InjectedNaN(model)
        self.oom_history: list[tuple[Rung, str]] = []
        model = model.to(self.device)
        if self.rung.activation_checkpointing:
            apply_activation_checkpointing(model)
        pcfg = dataclasses.replace(cfg.parallel, cpu_offload=self.rung.cpu_offload)
        self.model = parallelize(model, self.world, pcfg, bf16=cfg.train.precision == "bf16")
        # Evaluation calls the model itself, not a DDP wrapper (whose forward prepares a
        # gradient reduction); under FSDP the two are the same object.
        self.unwrapped = model
        self.sharded = self.world.mesh is not None and is_sharded(self.model)
        self.train_data = train_data
        # Compiling the loss function compiles the model's forward with it, so the compiler can
        # fuse the output projection with the cross-entropy; the model itself stays plain, and
        # its state dict keeps its own names.
        self.loss_fn = apply_compile(loss_fn) if cfg.train.compile else loss_fn
        self.eval_fn = eval_fn
        self.sample_fn = sample_fn
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_token = flops_per_token
        self.optimizer = build_optimizer(self.model, cfg.train, self.device)
        self.precision = Precision(cfg.train.precision, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.step = 0

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward pass now (the config's, or where the OOM ladder took it)."""
        return self.rung.micro_batch_size

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> FitResult:
        cfg, t = self.cfg, self.cfg.train
        resumed_from = self._restore()
        self._write_run_files()
        result = FitResult(step=self.step, resumed_from=resumed_from)
        if self.step >= t.max_steps:
            self._say(f"kiln: already trained to step {self.step} (train.max_steps={t.max_steps}); nothing to do")
            return result
        if self.world.is_main:
            logger = MetricsLogger(self.run_dir, total_steps=t.max_steps, start_step=self.step, console=self.console,
                                   wandb_project=cfg.observe.wandb_project if cfg.observe.wandb else None,
                                   config=cfg.to_dict())
        else:
            logger = NullLogger()
        batches = self._batches(self.step)
        meter = _Meter(self.device, self.world)
        clock = _Budget(parse_duration(t.time_budget) if t.time_budget else math.inf)
        with logger, _StopRequest() as stop:
            if self.probe_needed:
                self._find_micro_batch(logger)
            while self.step < t.max_steps:
                clock.step_started()
                self.profiler.step_begins(self.step + 1)
                lr = lr_at(self.step, t) * self.guard.lr_scale
                self.inject_nan.step = self.step + 1
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                with self.profiler.region("kiln/data"):
                    # This rank's share of the step's global batch, kept until the step is done
                    # so that a retry after running out of memory sees the same sequences.
                    batch = to_device(next(batches), self.device)
                with self.profiler.region("kiln/forward_backward"):
                    loss = self._forward_backward(batch, logger)
                with self.profiler.region("kiln/optimizer"):
                    self.precision.unscale_(self.optimizer)
                    grad_norm = clip_grad_norm_(self.params, t.grad_clip if t.grad_clip > 0 else math.inf)
                    # A NaN/Inf gradient norm (the same on every rank) skips the update, on the device.
                    self.precision.step(self.optimizer, finite=torch.isfinite(grad_norm))
                    if self.cfg.observe.histograms_every and (self.step + 1) % self.cfg.observe.histograms_every == 0:
                        logger.histograms(self.step + 1, self.unwrapped)
                    self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                meter.end_step(loss, grad_norm, batch_rows(batch))
                self.profiler.step_ends(self.step)

                # The run ends at max_steps, or early when the next step would overrun the time
                # budget; either way it ends with an evaluation and a checkpoint. Ranks decide
                # together, or one would wait forever in a collective the others skipped.
                out_of_time, stop.requested = self.world.agree(clock.next_step_overruns(), stop.requested)
                final = self.step == t.max_steps or out_of_time
                if self.step % t.log_every == 0 or final or stop.requested:
                    result.metrics, review = self._log(logger, meter, lr, clock.elapsed())
                    if review.rollback:
                        with meter.paused():
                            self._roll_back(logger)
                        batches = self._batches(self.step)
                        continue
                # Evaluation and saving are not training throughput: the meter's clock stops.
                with meter.paused():
                    if final or (cfg.eval.every and self.step % cfg.eval.every == 0):
                        result.eval_metrics = self._evaluate(logger) or result.eval_metrics
                    if final or stop.requested or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                        self.save()
                if out_of_time and self.step < t.max_steps:
                    result.out_of_time = True
                    self._say(f"kiln: time budget {t.time_budget} reached at step {self.step}/{t.max_steps}; "
                              "run the same command again to continue")
                    break
                if stop.requested:
                    result.interrupted = True
                    self._say(f"kiln: stopped at step {self.step}; resume with the same command")
                    break
        result.step = self.step
        return result

    # -- pieces of the loop --------------------------------------------------------------------

    def _forward_backward(self, batch: Any, logger: MetricsLogger) -> torch.Tensor:
        """The step's gradients and mean loss, retried one rung down the out-of-memory ladder
        each time the device runs out of memory."""
        while True:
            try:
                return self._accumulate(batch)
            except torch.OutOfMemoryError as e:
                error = str(e).splitlines()[0]
            # Outside the except block: the failed attempt's frames, and the activations they
            # reference, are gone before the retry allocates anew.
            self._step_down(error, logger)

    def _accumulate(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one step's batch, micro-batch by micro-batch; the mean loss."""
        micro_batches = split_batch(batch, self.rung.micro_batch_size)
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, micro in enumerate(micro_batches):
            with gradient_sync(self.model, i == n - 1):
                with self.precision.autocast():
                    loss = self.loss_fn(self.model, micro)
                self.inject_oom.check(batch_rows(micro), self.step, self.rung)
                # Each micro-batch loss is a mean, so dividing by the number of micro-batches
                # makes the summed gradients those of one big batch (and data-parallel ranks
                # average theirs).
                self.precision.backward(loss / n)
            total += loss.detach()
        return total / n

    def _batches(self, start_step: int) -> Iterator[Any]:
        t = self.cfg.train
        return iter(make_train_loader(
            self.train_data,
            schedule=self.schedule,
            seed=t.seed,
            start_step=start_step,
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
            # Ranks of one tensor-parallel group share a data-parallel rank, so the same batch.
            rank=self.world.dp_rank,
            world_size=self.world.dp,
        ))

    def _log(self, logger: MetricsLogger, meter: "_Meter", lr: float, elapsed_s: float) -> dict[str, float]:
        from kiln.models.flops import peak_flops

        values = meter.flush()  # the one host sync of the interval
        review = self._review(logger, values["losses"], values["grad_norms"])
        finite = [(l, g) for l, g in zip(values["losses"], values["grad_norms"]) if math.isfinite(l) and math.isfinite(g)]
        loss, grad_norm = (sum(v) / len(finite) for v in zip(*finite)) if finite else (math.nan, math.nan)
        samples = values["samples"] * self.world.dp
        tokens_per_s = samples * self.tokens_per_sample / values["seconds"]
        record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "elapsed_s": elapsed_s, "global_batch": self.schedule.batch_size(self.step - 1),
                  "micro_batch_size": self.rung.micro_batch_size,
                  "tokens": self.schedule.samples_before(self.step) * self.tokens_per_sample}
        peak = peak_flops(self.device)
        if peak and self.flops_per_token:
            record["mfu"] = self.flops_per_token * tokens_per_s / (peak * self.world.size)
        record.update(memory_stats(self.device))
        if self.precision.scaler.is_enabled():
            record["skipped_steps"] = self.precision.skipped_steps
            record["loss_scale"] = self.precision.scaler.get_scale()
        if self.guard.bad_total:
            record["nonfinite_steps"] = self.guard.bad_total
        logger.log(self.step, record)
        return record, review

    # -- the non-finite guard --------------------------------------------------------------------

    def _review(self, logger: MetricsLogger, losses: list[float], grad_norms: list[float]) -> StepReview:
        """Bad steps and loss spikes of the interval just ended, each logged as an event."""
        first = self.step - len(losses) + 1
        review = self.guard.review(first, losses, grad_norms)
        if review.bad_steps:
            step = review.bad_steps[0]
            module = self._locate_non_finite(step)
            where = (f"the first non-finite output is module '{module}'" if module else
                     "every module output was finite when the step's batch was run again (the loss or the backward "
                     "pass went non-finite)")
            logger.event(step, "non_finite", f"non-finite loss or gradient at step(s) "
                         f"{', '.join(map(str, review.bad_steps))}: update skipped; {where}",
                         steps=review.bad_steps, module=module)
        for step, loss in review.spikes:
            logger.event(step, "loss_spike", f"loss spike at step {step}: {loss:.4g}, far above its running mean; "
                         f"batch = {self._batch_description(step)}", loss=loss, batch=self._batch_positions(step))
        return review

    def _step_batch(self, step: int) -> Any:
        """This rank's batch of (1-based) ``step``, rebuilt from the data order."""
        return collate(self.train_data, next(iter(self._sampler(step - 1))), self.device)

    def _sampler(self, start_step: int) -> StepSampler:
        t = self.cfg.train
        return StepSampler(len(self.train_data), self.schedule, t.seed, start_step, self.world.dp_rank, self.world.dp)

    def _batch_positions(self, step: int) -> list[int]:
        """[first, end) positions of ``step``'s sequences in the run's data order (all ranks)."""
        start = self.schedule.samples_before(step - 1)
        return [start, start + self.schedule.batch_size(step - 1)]

    def _batch_description(self, step: int) -> str:
        first, end = self._batch_positions(step)
        items = next(iter(self._sampler(step - 1)))
        shown = ", ".join(map(str, items[:8])) + (", ..." if len(items) > 8 else "")
        return f"sequences {first}..{end - 1} of the data order (this rank's dataset items {shown})"

    def _locate_non_finite(self, step: int) -> str | None:
        batch = self._step_batch(step)
        was, self.inject_nan.step = self.inject_nan.step, step
        try:
            with self.precision.autocast():
                return first_non_finite_module(self.unwrapped, lambda: [
                    self.loss_fn(self.model, micro) for micro in split_batch(batch, self.rung.micro_batch_size)])
        finally:
            self.inject_nan.step = was

    def _roll_back(self, logger: MetricsLogger) -> None:
        """Back to the newest checkpoint with a lower learning rate, or stop with a report."""
        bad = self.step
        path = latest_checkpoint(self.checkpoint_dir)
        try:
            if path is None:
                raise TrainingDiverged(f"{self.cfg.guard.max_bad_steps} non-finite steps in a row by step {bad}, "
                                       "and no checkpoint to roll back to yet.")
            self.guard.start_rollback()
        except TrainingDiverged as e:
            raise TrainingDiverged(f"{e} Stopped at step {bad}. Lower train.lr, use bf16 rather than fp16, check the "
                                   "data (kiln doctor), or raise guard.max_bad_steps.") from None
        guard = self.guard.state_dict()
        self._load(path)
        self.guard.load_state_dict(guard)  # the lowered rate and the rollback count are newer than the checkpoint
        self.inject_nan.rolled_back(bad)
        logger.rewind(self.step)
        logger.event(self.step, "rollback", f"{self.cfg.guard.max_bad_steps} non-finite steps in a row by step {bad}: "
                     f"rolled back to {path.name}, learning rate x{self.guard.lr_scale:g} from now on",
                     checkpoint=str(path), lr_scale=self.guard.lr_scale)

    def _evaluate(self, logger: MetricsLogger) -> dict[str, float] | None:
        if self.eval_fn is None and self.sample_fn is None:
            return None
        was_training = self.model.training
        self.model.eval()
        model = self.unwrapped
        metrics = None
        try:
            with torch.no_grad(), self.precision.autocast():
                if self.eval_fn is not None:
                    metrics = {k: float(v) for k, v in self.eval_fn(model).items()}
                    logger.log(self.step, metrics)
                # The built-in sampler's KV cache holds every head, which a tensor-parallel
                # rank does not have; samples are skipped there.
                if self.sample_fn is not None and self.world.tp == 1:
                    logger.text(self.step, "sample", self.sample_fn(model, self.step))
        finally:
            self.model.train(was_training)
        return metrics

    # -- memory: the micro-batch probe and the out-of-memory ladder -----------------------------

    def _micro_batch_options(self) -> list[int]:
        t, dp = self.cfg.train, self.world.dp
        uneven = [b for b in self.schedule.sizes() if b % dp]
        if uneven:
            key = "train.global_batch_size" if uneven[0] == t.global_batch_size else "train.batch_ramp_start/increment"
            raise ConfigError([f"{key}: global batch {uneven[0]} is not a multiple of the {dp} data-parallel ranks"])
        return micro_batch_options([b // dp for b in self.schedule.sizes()])

    def _initial_rung(self) -> tuple[Rung, bool]:
        """The config's settings, made more frugal by a rung the run already reached (memory.json)."""
        t = self.cfg.train
        micro = t.micro_batch_size
        if micro != "auto" and micro not in self.micro_options:
            shares = ", ".join(f"{b} / {self.world.dp} = {b // self.world.dp}" for b in self.schedule.sizes())
            raise ConfigError([f"train.micro_batch_size: {micro} does not divide each data-parallel rank's share of "
                               f"train.global_batch_size ({shares}); accumulation steps must be a whole number"])
        if micro == "auto" and self.world.distributed and (self.cfg.parallel.strategy != "ddp" or self.world.tp > 1):
            # Probing is safe only without collectives in forward/backward: one rank running
            # out of memory inside an FSDP all-gather would leave the others waiting there.
            raise ConfigError(["train.micro_batch_size: auto works with one process or DDP; with FSDP or tensor "
                               "parallelism set a number (kiln plan estimates what fits)"])
        rung = Rung(self.micro_options[0] if micro == "auto" else micro, t.activation_checkpointing,
                    self.cfg.parallel.cpu_offload)
        saved = None if self.cfg.checkpoint.resume == "never" else read_rung_file(self.run_dir)
        if saved is not None:
            if saved.micro_batch_size not in self.micro_options:
                saved = dataclasses.replace(saved, micro_batch_size=max(m for m in self.micro_options
                                                                        if m <= saved.micro_batch_size))
            rung = rung.merge(saved)
            self._say(f"kiln: continuing with {rung.describe()}, where this run's out-of-memory ladder got to "
                      f"({self.run_dir / 'memory.json'}; delete it to start from the config's settings)")
        return rung, micro == "auto" and saved is None

    def _apply_rung(self, rung: Rung) -> None:
        if rung.activation_checkpointing and not self.rung.activation_checkpointing:
            apply_activation_checkpointing(self.unwrapped)
        self.rung = rung

    def _can_offload(self) -> bool:
        return self.cfg.parallel.strategy != "ddp" and self.device.type == "cuda"

    def _free_failed_attempt(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # the partial gradients of the failed attempt
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _step_down(self, error: str, logger: MetricsLogger) -> None:
        """After an out-of-memory error in forward/backward: free, move one rung down, go on."""
        self._free_failed_attempt()
        self.oom_history.append((self.rung, error))
        where = f"out of memory at step {self.step + 1} with {self.rung.describe()}"
        rung = next_rung(self.rung, self.micro_options, can_offload=self._can_offload())
        if rung is None:
            if not self.world.distributed:  # the other ranks of a group wait in a collective: no save
                self.save()
            raise OutOfMemoryExhausted(self._oom_report(where))
        if self.world.distributed or rung.cpu_offload:
            # Other ranks are inside collectives of this step (or the model must be sharded anew):
            # the rung is saved and the run restarts from its last checkpoint.
            write_rung_file(self.run_dir, rung)
            if not self.world.distributed:
                self.save()
            raise RestartForRung(f"{where} ({error}); it will continue from its last checkpoint with "
                                 f"{rung.describe()}, saved in {self.run_dir / 'memory.json'}: run the same command "
                                 "again (kiln launch --max-restarts N restarts by itself)")
        self._apply_rung(rung)
        if self.world.is_main:
            write_rung_file(self.run_dir, rung)
        accum = self.schedule.batch_size(self.step) // self.world.dp // rung.micro_batch_size
        logger.event(self.step + 1, "out_of_memory", f"{where}: retrying the step with {rung.describe()} "
                     f"(accumulation {accum}; the global batch is unchanged)", error=error, **rung.state_dict())

    def _oom_report(self, where: str) -> str:
        tried = "\n".join(f"  - {rung.describe()}: {error}" for rung, error in self.oom_history)
        saved = "" if self.world.distributed else f"\nThe state after step {self.step} is saved in {self.checkpoint_dir}."
        return (f"{where}, the last rung of the out-of-memory ladder.\nTried:\n{tried}{saved}\n"
                "To fit: a shorter data.seq_len, a smaller model, parallel.strategy=fsdp over more GPUs (with "
                "parallel.cpu_offload=true), or a GPU with more memory; `kiln plan` estimates each.")

    def _find_micro_batch(self, logger: MetricsLogger) -> None:
        """train.micro_batch_size = "auto": the largest micro-batch whose forward and backward
        fit (with a margin on GPU), found by bisection over real passes on training data."""
        data = self.train_data
        rng = capture_rng()  # probing must not change what the run draws afterwards

        def fits(m: int) -> bool:
            batch = collate(data, [i % len(data) for i in range(m)], self.device)
            failed = False
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            try:
                with gradient_sync(self.model, False), self.precision.autocast():
                    loss = self.loss_fn(self.model, batch)
                self.inject_oom.check(m, self.step, self.rung)
                self.precision.backward(loss)
                failed = not self._leaves_headroom()
            except torch.OutOfMemoryError as e:
                self.oom_history.append((dataclasses.replace(self.rung, micro_batch_size=m), str(e).splitlines()[0]))
                failed = True
            self._free_failed_attempt()
            (failed,) = self.world.agree(failed)  # every rank takes the same size
            return not failed

        best = largest_fitting(self.micro_options, fits)
        if best is None:
            self._apply_rung(dataclasses.replace(self.rung, activation_checkpointing=True))
            best = largest_fitting(self.micro_options, fits)
        restore_rng(rng)
        if best is None:
            raise OutOfMemoryExhausted(self._oom_report("train.micro_batch_size=auto: out of memory at micro-batch 1 "
                                                        "with activation checkpointing"))
        self.rung = dataclasses.replace(self.rung, micro_batch_size=best)
        if self.world.is_main:
            write_rung_file(self.run_dir, self.rung)
        accum = self.cfg.train.global_batch_size // self.world.dp // best
        logger.event(self.step, "micro_batch_size",
                     f"train.micro_batch_size=auto: {self.rung.describe()} fits, accumulation {accum}",
                     **self.rung.state_dict())

    def _leaves_headroom(self) -> bool:
        """On a GPU, would the probed pass leave the margin free once AdamW has its state too?"""
        if self.device.type != "cuda":
            return True
        total = torch.cuda.get_device_properties(self.device).total_memory
        states = 0 if self.optimizer.state else 2 * sum(p.numel() * 4 for p in self.params)
        return torch.cuda.max_memory_reserved(self.device) + states <= (1 - PROBE_MARGIN) * total

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> Path:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t = self.cfg.train
        # Model and optimizer state keyed by parameter name (no "module." of DDP), each rank's
        # shards when sharded: so any strategy or world size can load it back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        train_state = {
            "step": self.step,
            "precision": self.precision.state_dict(),
            "rng": capture_rng(),
            # The data order is a pure function of (seed, step): this is the whole position.
            "data": {"seed": t.seed, "step": self.step, "samples_seen": self.schedule.samples_before(self.step)},
            "memory": self.rung.state_dict(),
            "guard": self.guard.state_dict(),
            "config": self.cfg.to_dict(),
            "world": {"size": self.world.size, "tp": self.world.tp, "strategy": self.cfg.parallel.strategy},
        }
        if self.sharded:
            weights, sharded = None, {"model": model_state, "optimizer": optim_state}
        else:
            weights, sharded = model_state, None
            train_state["optimizer"] = optim_state
        path = save_checkpoint(self.checkpoint_dir, self.step, weights, train_state, keep=self.cfg.checkpoint.keep,
                               sharded_state=sharded, world=self.world)
        self._say(f"kiln: saved checkpoint {path}")
        return path

    def _restore(self) -> int | None:
        resume = self.cfg.checkpoint.resume
        if resume == "never":
            if list_checkpoints(self.checkpoint_dir):
                raise FileExistsError(
                    f"run.dir {self.run_dir} already holds checkpoints and checkpoint.resume is 'never'; "
                    "choose another run.dir or set checkpoint.resume=auto"
                )
            return None
        path = latest_checkpoint(self.checkpoint_dir) if resume == "auto" else Path(resume)
        if path is None:
            return None
        train_state = self._load(path)
        self.guard.load_state_dict(train_state.get("guard"))
        self._say(f"kiln: resumed from {path} at step {self.step}")
        return self.step

    def _load(self, path: Path) -> dict:
        """Load model, optimizer, precision, memory rung, RNG and step from a checkpoint."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        model_state, train_state = load_checkpoint(path, weights_only=False)
        if model_state is None:  # sharded: DCP fills this process's own layout, resharding as needed
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            load_sharded(path, state)
            model_state, optim_state, full = state["model"], state["optimizer"], False
        else:
            optim_state, full = train_state["optimizer"], True
        try:
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=StateDictOptions(full_state_dict=full and self.sharded))
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"{path}: the checkpoint does not fit this model (was [model] changed?); use a new run.dir "
                f"or --resume never. {str(e).splitlines()[0][:300]}"
            ) from None
        self.precision.load_state_dict(train_state["precision"])
        saved = Rung.from_state(train_state.get("memory"))
        if saved is not None:
            # Offload is decided when the model is sharded, from memory.json; the rest applies now.
            self._apply_rung(self.rung.merge(dataclasses.replace(saved, cpu_offload=self.rung.cpu_offload)))
            self.probe_needed = False
        restore_rng(train_state["rng"])
        self.step = train_state["step"]
        return train_state

    def _write_run_files(self) -> None:
        if not self.world.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.cfg.to_toml())
        env = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor(),
            "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "world_size": self.world.size,
            "parallel": {"strategy": self.cfg.parallel.strategy, "dp": self.world.dp, "tp": self.world.tp},
        }
        (self.run_dir / "env.json").write_text(json.dumps(env, indent=2))

    def _say(self, msg: str) -> None:
        if self.console:
            print(msg, flush=True)


class _Budget:
    """Wall-clock limit of one ``fit`` call, checked on the host at step boundaries (no sync)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._t0 = time.perf_counter()
        self._step_t0 = self._t0

    def step_started(self) -> None:
        self._step_t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def next_step_overruns(self) -> bool:
        """Would one more step, as long as the last one, end past the budget?"""
        now = time.perf_counter()
        return (now - self._t0) + (now - self._step_t0) > self.seconds


class _Meter:
    """Per-step values kept on the device between log points."""

    def __init__(self, device: torch.device, world: World):
        self.device = device
        self.world = world
        self._reset()

    def _reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []
        self.samples = 0
        self._t0 = time.perf_counter()
        self._paused_s = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t0

    def end_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, samples: int) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm.detach().float())
        self.samples += samples

    def flush(self) -> dict[str, Any]:
        """Per-step losses (averaged over ranks) and gradient norms of the interval, read in one go."""
        per_step = torch.stack([self.world.mean(torch.stack(self.losses)).float(), torch.stack(self.grad_norms)])
        losses, grad_norms = per_step.tolist() if self.losses else ([], [])
        values = {
            "losses": losses,
            "grad_norms": grad_norms,
            "samples": self.samples,
            "seconds": max(1e-9, time.perf_counter() - self._t0 - self._paused_s),
        }
        self._reset()
        return values
