"""The run around the loop: the files that describe it, the signals that stop it at a step
boundary, its wall-clock budget, and loading a run directory back (to evaluate, sample or export)."""

from __future__ import annotations

import dataclasses
import json
import platform
import random
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from kiln.checkpoint import CheckpointError, checkpoint_step, latest_checkpoint, load_checkpoint, load_sharded
from kiln.checkpoint.weights import load_weights
from kiln.config import Config, from_dict, tomllib
from kiln.device import resolve_device
from kiln.distributed.world import World
from kiln.models.family import BUILT_IN
from kiln.train.jobs import FamilyJob, LoadedRun, job_for


def seed_everything(seed: int) -> None:
    """Python's ``random``, NumPy's global generator and torch's (the CPU's and every GPU's) seeded
    from ``train.seed`` at the start of a run, so that a job's own use of them is reproducible
    and two runs of one seed write the same RNG states into their checkpoints."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def write_run_files(run_dir: Path, cfg: Config, world: World, model: nn.Module) -> None:
    """``config.toml`` (the resolved config: with the steps and batch the run trains with, those
    its time plan found for "auto") and ``env.json`` (software, device, parallel layout)."""
    if not world.is_main:
        return
    device = world.device
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "world_size": world.size,
        "parallel": {
            "strategy": cfg.parallel.strategy,
            "pp": world.pp,
            "dp": world.dp,
            "dp_replicate": world.dp_replicate,
            "tp": world.tp,
            "cp": world.cp,
            "ep": world.ep,
        },
    }
    (run_dir / "env.json").write_text(json.dumps(env, indent=2))


@dataclasses.dataclass
class FitResult:
    """What ``Trainer.fit`` did: the step it reached, the last logged and evaluated metrics, where
    it resumed from, and whether a signal or the time budget stopped it."""

    step: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    resumed_from: int | None = None
    interrupted: bool = False
    out_of_time: bool = False


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves and stops at the next step boundary, so a
    checkpoint is never taken from a half-applied optimizer step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\nkiln: received signal {signum}; saving a checkpoint at the end of this step "
            "(send it again to stop at once)",
            flush=True,
        )

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Budget:
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


@dataclasses.dataclass
class Progress:
    """The run in progress, one per ``fit``: the loop sets the step's values, the components
    called after it read them, and may stop the run or roll it back."""

    logger: Any
    stop: StopRequest  # a signal, or an evaluation's answer, sets it; nothing clears it
    result: FitResult
    clock: Budget
    step: int = 0  # steps done (a rollback sets it back)
    lr: float = 0.0  # the step's learning rate
    micro_batch_size: int = 0  # in use at the step
    planned_steps: int = 0  # the run's length, as the time plan has it now
    final: bool = False  # the run's last step: the planned one, or the last the budget allows
    out_of_time: bool = False
    rolled_back: bool = False  # the guard rolled the run back to ``step``; nothing else runs


class AfterStep(Protocol):
    """A component the loop calls after each step, in the watchdog's and profiler's ``phase``."""

    phase: str

    def after_step(self, run: Progress) -> None: ...


def load_run(
    path: str | Path, checkpoint: str | Path | None = None, device: str = "auto", trust: bool = False
) -> LoadedRun:
    """A model with its tokenizer, in eval mode, from ``path``: a run directory (at its newest
    complete checkpoint, or ``checkpoint``), one of its checkpoint directories, or a directory
    ``kiln export`` wrote in the ``safetensors`` or ``hf`` format. The run's job (its config's
    ``run.job``) says how its model and tokenizer are read. Nothing is read from the data or its cache.
    A run whose config names a plug-in model family is loaded only with ``trust`` (``saved_job``)."""
    path = Path(path)
    if (path / "export.json").is_file():
        info = json.loads((path / "export.json").read_text())
        fmt, step, task = info.get("format"), int(info.get("step", 0)), info.get("task", "causal_lm")
        return load_export(path, fmt, device, step, task, trust=trust)
    run_dir, path = find_checkpoint(path, checkpoint)
    model_state, _ = load_checkpoint(path)
    job = saved_job(run_dir, trust)
    args, model = job.saved_model(run_dir)
    if model_state is None:  # saved sharded: gather it into this one process
        model_state = model.state_dict()
        load_sharded(path, {"model": model_state})
    model.load_state_dict(model_state)
    model.to(resolve_device(device)).eval()
    return LoadedRun(
        job.cfg, job, job.family, args, model, job.saved_tokenizer(run_dir), path, checkpoint_step(path), run_dir
    )


def find_checkpoint(path: Path, checkpoint: str | Path | None = None) -> tuple[Path, Path]:
    """The run directory and the checkpoint that ``load_run`` reads for ``path`` (a run
    directory, or one of its checkpoints) and ``checkpoint`` (by default the newest complete one)."""
    if checkpoint is None and path.parent.name == "checkpoints" and (path.parent.parent / "config.toml").is_file():
        path, checkpoint = path.parent.parent, path
    for name in ("config.toml", "model.json"):
        if not (path / name).exists():
            raise CheckpointError(f"{path}: not a kiln run directory (missing {name})")
    found = Path(checkpoint) if checkpoint else latest_checkpoint(path / "checkpoints")
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint in {path / 'checkpoints'}")
    return path, found


def saved_job(directory: Path, trust: bool = False) -> FamilyJob:
    """The job of the ``config.toml`` of a run or a safetensors export. A run directory is data,
    not code: one whose config names a plug-in model family (a module that loading it imports and
    runs) is refused unless ``trust`` says its source is trusted (``--trust-checkpoint``)."""
    file = directory / "config.toml"
    cfg = from_dict(tomllib.loads(file.read_text()))
    if not trust and not cfg.model.source and cfg.model.family not in BUILT_IN:
        module = cfg.model.family.partition(":")[0]
        raise CheckpointError(
            f"{file}: model.family = {cfg.model.family!r} is a plug-in: loading this run imports and runs {module}; "
            "pass --trust-checkpoint if you trust where the run comes from"
        )
    return job_for(cfg)


def load_export(
    path: Path, fmt: str, device: str = "auto", step: int = 0, task: str = "causal_lm", trust: bool = False
) -> LoadedRun:
    """A directory ``kiln export`` wrote: safetensors (kiln's names, beside the run's config) or hf
    (loaded through ``transformers`` as the hf family loads any model directory)."""
    if fmt == "safetensors":
        job = saved_job(path, trust)
        args, model = job.saved_model(path)
        load_weights(model, path)
        tokenizer = job.saved_tokenizer(path)
    elif fmt == "hf":
        kind = "classify" if task == "sequence_classification" else "lm"
        job = job_for(from_dict({"run": {"job": kind}, "model": {"source": f"hf:{path}", "task": task}}))
        args = job.family.resolve(job.cfg.model, vocab_size=0, seq_len=0)
        model = job.family.create(args, "cpu", job.cfg.train.seed)
        tokenizer = job.family.tokenizer(args)
    else:
        raise CheckpointError(
            f"{path}: a {fmt} export runs without kiln (see its export.json); kiln loads run directories "
            "and the safetensors and hf exports"
        )
    model.to(resolve_device(device)).eval()
    return LoadedRun(job.cfg, job, job.family, args, model, tokenizer, path, step, path)
