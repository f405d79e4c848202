"""The training loop. It trains any ``nn.Module`` given a dataset and a loss; the built-in GPT
job (``kiln.train.lm``) is one user of it.

Read ``Trainer.fit`` top to bottom: restore, then for each step accumulate micro-batches, clip,
step, and at intervals log, evaluate and checkpoint. Every feature is an object the loop calls
the same way in every configuration (precision, schedule, checkpoint store, logger) rather
than a flag checked along the way.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.checkpoint import (CheckpointError, capture_rng, latest_checkpoint, list_checkpoints, load_checkpoint,
                             load_sharded, restore_rng, save_checkpoint)
from kiln.config import Config, ConfigError, parse_duration, validate
from kiln.data.loader import make_train_loader
from kiln.distributed.parallelize import clip_grad_norm_, gradient_sync, is_sharded, parallelize
from kiln.distributed.world import World, init_world
from kiln.observe import MetricsLogger, NullLogger
from kiln.observe.memory import memory_stats
from kiln.train.apply import apply_activation_checkpointing, apply_compile
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
        self.run_dir = Path(cfg.run.dir)
        self.accum = cfg.grad_accum_steps(self.world.dp)
        if cfg.train.global_batch_size % (cfg.train.micro_batch_size * self.world.dp):
            raise ConfigError([f"train.global_batch_size: {cfg.train.global_batch_size} is not a multiple of "
                               f"train.micro_batch_size x data-parallel ranks = {cfg.train.micro_batch_size} x {self.world.dp}"])
        model = model.to(self.device)
        if cfg.train.activation_checkpointing:
            apply_activation_checkpointing(model)
        self.model = parallelize(model, self.world, cfg.parallel, bf16=cfg.train.precision == "bf16")
        # Evaluation calls the model itself, not a DDP wrapper (whose forward prepares a
        # gradient reduction); under FSDP the two are the same object.
        self.unwrapped = model
        self.sharded = self.world.distributed and is_sharded(self.model)
        self.train_data = train_data
        # Compiling the loss function compiles the model's forward with it, so the compiler can
        # fuse the output projection with the cross-entropy; the model itself stays plain, and
        # its state dict keeps its own names.
        self.loss_fn = apply_compile(loss_fn) if cfg.train.compile else loss_fn
        self.eval_fn = eval_fn
        self.sample_fn = sample_fn
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_token = flops_per_token
        self.console = console and self.world.is_main
        self.optimizer = build_optimizer(self.model, cfg.train, self.device)
        self.precision = Precision(cfg.train.precision, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.step = 0

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> FitResult:
        cfg, t = self.cfg, self.cfg.train
        accum = self.accum
        resumed_from = self._restore()
        self._write_run_files()
        result = FitResult(step=self.step, resumed_from=resumed_from)
        if self.step >= t.max_steps:
            self._say(f"kiln: already trained to step {self.step} (train.max_steps={t.max_steps}); nothing to do")
            return result
        if self.world.is_main:
            logger = MetricsLogger(self.run_dir, total_steps=t.max_steps, start_step=self.step, console=self.console)
        else:
            logger = NullLogger()
        batches = self._batches(self.step)
        meter = _Meter(self.device, self.world)
        clock = _Budget(parse_duration(t.time_budget) if t.time_budget else math.inf)
        with logger, _StopRequest() as stop:
            while self.step < t.max_steps:
                clock.step_started()
                lr = lr_at(self.step, t)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                for micro in range(accum):
                    batch = to_device(next(batches), self.device)
                    with gradient_sync(self.model, micro == accum - 1):
                        with self.precision.autocast():
                            loss = self.loss_fn(self.model, batch)
                        # Each micro-batch loss is a mean, so dividing by the number of
                        # micro-batches makes the summed gradients those of one big batch (and
                        # data-parallel ranks average theirs).
                        self.precision.backward(loss / accum)
                    meter.loss += loss.detach()
                self.precision.unscale_(self.optimizer)
                grad_norm = clip_grad_norm_(self.params, t.grad_clip if t.grad_clip > 0 else math.inf)
                self.precision.step(self.optimizer)
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                meter.end_step(grad_norm, accum)

                # The run ends at max_steps, or early when the next step would overrun the time
                # budget; either way it ends with an evaluation and a checkpoint. Ranks decide
                # together, or one would wait forever in a collective the others skipped.
                out_of_time, stop.requested = self.world.agree(clock.next_step_overruns(), stop.requested)
                final = self.step == t.max_steps or out_of_time
                if self.step % t.log_every == 0 or final or stop.requested:
                    result.metrics = self._log(logger, meter, lr, clock.elapsed())
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

    def _batches(self, start_step: int) -> Iterator[Any]:
        t = self.cfg.train
        return iter(make_train_loader(
            self.train_data,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
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
        samples = values["micro_batches"] * self.cfg.train.micro_batch_size * self.world.dp
        tokens_per_s = samples * self.tokens_per_sample / values["seconds"]
        record = {"loss": values["loss"], "lr": lr, "grad_norm": values["grad_norm"], "tokens_per_s": tokens_per_s,
                  "elapsed_s": elapsed_s}
        peak = peak_flops(self.device)
        if peak and self.flops_per_token:
            record["mfu"] = self.flops_per_token * tokens_per_s / (peak * self.world.size)
        record.update(memory_stats(self.device))
        if self.precision.scaler.is_enabled():
            record["skipped_steps"] = self.precision.skipped_steps
            record["loss_scale"] = self.precision.scaler.get_scale()
        logger.log(self.step, record)
        return record

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
            "data": {"seed": t.seed, "step": self.step, "samples_seen": self.step * t.global_batch_size},
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

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
        restore_rng(train_state["rng"])
        self.step = train_state["step"]
        self._say(f"kiln: resumed from {path} at step {self.step}")
        return self.step

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
    """Sums of per-step values kept on the device between log points."""

    def __init__(self, device: torch.device, world: World):
        self.device = device
        self.world = world
        self._reset()

    def _reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = 0
        self.micro_batches = 0
        self._t0 = time.perf_counter()
        self._paused_s = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t0

    def end_step(self, grad_norm: torch.Tensor, micro_batches: int) -> None:
        self.grad_norm += grad_norm.detach()
        self.steps += 1
        self.micro_batches += micro_batches

    def flush(self) -> dict[str, float]:
        steps = max(1, self.steps)
        values = {
            "loss": self.world.mean(self.loss).item() / max(1, self.micro_batches),
            "grad_norm": self.grad_norm.item() / steps,
            "micro_batches": self.micro_batches,
            "seconds": max(1e-9, time.perf_counter() - self._t0 - self._paused_s),
        }
        self._reset()
        return values
