"""Model, input-pipeline and determinism checks of ``kiln doctor``.

Each starts from a fresh copy of the untrained model and steps it the way the Trainer does:
kiln's AdamW parameter groups, the configured precision (autocast, loss scaling) and gradient
clipping. They run eagerly (train.compile and activation checkpointing do not change what is
checked) and are kept small: one batch of a few sequences, a few steps.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.config import TrainConfig
from kiln.data.batch import collate, to_device
from kiln.data.loader import dataset_len, make_train_loader
from kiln.distributed.parallelize import parallelize
from kiln.distributed.world import World
from kiln.doctor.data import data_scan
from kiln.doctor.job import Subject
from kiln.models.family import ParallelPlan
from kiln.train.optim import build_optimizer, lr_at
from kiln.train.precision import Precision
from kiln.train.step import TrainStep

SMALL_BATCH = 4  # samples (sequences) in the one-batch checks
INITIAL_LOSS_TOLERANCE = 1.5  # nats from ln(vocab)
OVERFIT_MAX_STEPS = 100
OVERFIT_MAX_SECONDS = 60.0
OVERFIT_WARMUP = 10  # steps of linear warmup, at most train.warmup_steps
OVERFIT_PASS_RATIO = 0.1  # memorised: the loss fell to this fraction of its start
OVERFIT_STUCK_RATIO = 0.9  # above this fraction after all steps: no real progress
OVERFIT_DIVERGED_RATIO = 2.0  # above this multiple of the start at any step: diverging
PIPELINE_STEPS = 3  # measured, after one step that starts the workers
PIPELINE_WAIT_WARN = 0.20  # share of a step spent waiting for data
LOAD_NEGLIGIBLE = 0.05  # loading a batch in-process costs under this share of a step: no workers needed
DETERMINISM_STEPS = 3
DETERMINISM_NOISE = 1e-4  # relative loss difference still blamed on reduction order, not a bug


def _rate(step: int, t: TrainConfig) -> float:
    """The run's learning rate at ``step``; with max_steps = "auto", whose steps only the run
    plans, as in a long run (its first steps warm up, then hold the peak)."""
    return lr_at(step, t, 10**6 if t.max_steps == "auto" else None)


class _Run:
    """A fresh model with kiln's optimizer and precision, stepped by the Trainer's own step."""

    def __init__(self, job: Subject):
        t = job.cfg.train
        assert job.new_model is not None  # model_blocker lets no check without a model get here
        self.model = job.new_model()
        self.model.train()
        # One process, as the Trainer lays it out.
        model = parallelize(self.model, ParallelPlan.infer(self.model), World(device=job.device), job.cfg.parallel)
        self.train_step = TrainStep(
            model,
            job.loss_fn,
            build_optimizer(model, t, job.device),
            Precision(t.precision, job.device),
            grad_clip=t.grad_clip,
        )
        self.steps = 0

    def step(self, batch: Any, lr: float, inspect: Callable[[nn.Module], None] | None = None) -> float:
        """One optimizer step on ``batch``; the loss before it. ``inspect`` sees the unscaled
        gradients before clipping."""
        self.steps += 1
        loss = self.train_step.forward_backward([batch], self.steps)
        self.train_step.update(lr, inspect)
        return loss.item()


def small_batch(job: Subject, size: int = SMALL_BATCH) -> Any:
    data = _train_data(job)
    return collate(data, range(min(size, dataset_len(data))), job.device, job.collate_fn)


def _train_data(job: Subject) -> Dataset:
    """The training data of a check that runs the model: model_blocker lets none without it get here."""
    assert job.train_data is not None
    return job.train_data


class GradientProbe:
    """Two steps of a fresh model on one small batch: the initial loss, each parameter's
    gradient norm at the first step, and which parameters got a non-zero gradient in either.

    Two steps, not one, so that a parameter whose gradient is zero only at initialisation (behind
    a zero-initialised layer) is not reported as cut off."""

    def __init__(self, job: Subject):
        run = _Run(job)
        batch = small_batch(job)
        self.names = [n for n, p in run.model.named_parameters() if p.requires_grad]
        self.norms: dict[str, float | None] = {}
        self.reached: set[str] = set()
        self.losses = [run.step(batch, _rate(s, job.cfg.train), self._inspect) for s in range(2)]

    def _inspect(self, model: nn.Module) -> None:
        first = not self.norms
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is not None and bool(p.grad.ne(0).any()):
                self.reached.add(name)
            if first:
                self.norms[name] = None if p.grad is None else float(p.grad.detach().float().norm())


def gradient_probe(job: Subject) -> GradientProbe:
    """The job's gradient probe, run once for the initial-loss and gradient checks."""
    return job.shared(GradientProbe)


def model_blocker(job: Subject) -> str | None:
    """Why the model cannot be run on this data (then its checks are skipped), or None."""
    if job.device_problem:
        # Falling back to the CPU could take hours for a model sized for a GPU.
        return f"run.device={job.cfg.run.device} cannot be used; see environment / device & CUDA"
    if job.new_model is None:
        return "no model to check: " + (job.data_problem or "the data could not be prepared")
    if job.train_data is None:
        return "no training data: " + (job.data_problem or "the data could not be prepared")
    splits = (("train", job.train_data), ("val", job.val_data))
    empty = [split for split, data in splits if data is not None and not dataset_len(data)]
    if empty:
        # Training would refuse this data too (and a data.seq_len this long makes each step slow).
        return f"the {' and '.join(empty)} split holds no whole sequence; see data / data source"
    bad = data_scan(job).out_of_vocab()
    if bad:
        # On a GPU an out-of-range embedding index is a device-side assert that breaks the
        # CUDA context for everything after it, so the model is not run at all.
        return f"token ids outside the vocabulary ({bad}); see data / token ids"
    return None


# -- model and optimizer --------------------------------------------------------------------------


def check_initial_loss(job: Subject):
    if blocker := model_blocker(job):
        return "skip", blocker, ""
    loss, expected = gradient_probe(job).losses[0], job.uniform_loss
    if expected is None:
        evidence = f"initial loss {loss:.3f} (pretrained weights: no uniform guess to compare with)"
        if not math.isfinite(loss):
            return "fail", evidence, "the model gives a non-finite loss before any step: check the loss and the inputs"
        return "pass", evidence, ""
    outputs = (
        f"{len(job.finetune.labels)} classes"
        if job.finetune and job.finetune.labels
        else (f"vocabulary {job.vocab_size:,}")
    )
    evidence = f"initial loss {loss:.3f}, ln({outputs}) = {expected:.3f} (a uniform guess)"
    if not math.isfinite(loss):
        return "fail", evidence, "the untrained model already gives a non-finite loss: check the loss and the inputs"
    if abs(loss - expected) > INITIAL_LOSS_TOLERANCE:
        return (
            "warn",
            evidence + f": {abs(loss - expected):.2f} nats apart",
            "an untrained model should be unsure of every token: check the output layer's initialisation "
            "(too large a scale makes it confidently wrong) and that the loss averages over tokens",
        )
    return "pass", evidence, ""


def check_gradient_flow(job: Subject):
    if blocker := model_blocker(job):
        return "skip", blocker, ""
    probe = gradient_probe(job)
    missing = [n for n in probe.names if n not in probe.reached]
    if missing:
        none = [n for n in missing if probe.norms.get(n) is None]
        return (
            "fail",
            f"{len(missing)} of {len(probe.names)} trainable parameters got no gradient in 2 steps "
            f"({len(none)} None, {len(missing) - len(none)} all zero): {_names(missing)}",
            "these parameters never train: use them in forward (or remove them), check for .detach(), "
            "torch.no_grad or integer casts on their path, or set requires_grad=False if they are meant to be "
            "frozen",
        )
    return "pass", f"all {len(probe.names)} trainable parameters got a non-zero gradient", ""


def check_gradient_norms(job: Subject):
    if blocker := model_blocker(job):
        return "skip", blocker, ""
    norms = gradient_probe(job).norms
    bad = [n for n, v in norms.items() if v is not None and not math.isfinite(v)]
    if bad:
        return (
            "fail",
            f"non-finite gradients at the first step in {len(bad)} parameters: {_names(bad)}",
            f"find the first operation that overflows (a log or division by zero, an fp16 overflow, a too "
            f"large initialisation); the loss itself was {gradient_probe(job).losses[0]:.4g}",
        )
    layers: dict[str, float] = {}
    for name, v in norms.items():
        if v is not None:
            layers[_layer(name)] = layers.get(_layer(name), 0.0) + v * v
    layers = {k: math.sqrt(v) for k, v in layers.items()}
    if not layers:
        return "skip", "no parameter got a gradient (see gradient flow)", ""
    low, high = min(layers, key=layers.__getitem__), max(layers, key=layers.__getitem__)
    total = math.sqrt(sum(v * v for v in layers.values()))
    return (
        "pass",
        f"finite in {_count(len(layers), 'layer')} at the first step: from {layers[low]:.2e} ({low}) to "
        f"{layers[high]:.2e} ({high}), total {total:.3g}",
        "",
    )


_BROKEN = (
    "the setup cannot learn one batch: check the loss (targets shifted against inputs, the reduction), "
    "that the optimizer sees the parameters, and the gradient flow check"
)


def check_overfit(job: Subject):
    """Memorise one small batch at train.lr. When that fails, one more run at a rate 10x lower
    (after divergence) or higher (after no progress) tells a bad rate from a broken model."""
    if blocker := model_blocker(job):
        return "skip", blocker, ""
    lr = job.cfg.train.lr
    first = _overfit(job, lr)
    if math.isfinite(first[0]) and first[0] <= 0:
        return "skip", f"the loss starts at {first[0]:.4g}: falling to a fraction of it needs a positive loss", ""
    outcome = _outcome(first)
    warmup = min(job.cfg.train.warmup_steps, OVERFIT_WARMUP)
    setup = f"AdamW on one batch of {min(SMALL_BATCH, dataset_len(_train_data(job)))} samples" + (
        f", {warmup} warmup steps" if warmup else ""
    )
    evidence = f"{_trajectory(lr, first)} ({setup})"
    if outcome == "memorised":
        return "pass", evidence, ""
    if outcome == "slow":
        return (
            "warn",
            f"{evidence}: it falls, but not below {OVERFIT_PASS_RATIO:.0%} of the start",
            "the model learns slowly at this rate: expected if train.lr is deliberately low (fine-tuning); "
            "otherwise raise train.lr, or check that the model can memorise a few samples",
        )
    other_lr = lr / 10 if outcome == "diverged" else lr * 10
    other = _overfit(job, other_lr)
    evidence += f"; {_trajectory(other_lr, other)}"
    learns = _outcome(other) in ("memorised", "slow")
    if outcome == "diverged":
        if learns:
            return "fail", f"{evidence}: train.lr={lr:g} diverges", f"lower train.lr, to {other_lr:g} or below"
        return (
            "fail",
            f"{evidence}: it diverges at both rates",
            f"lower train.lr well below {other_lr:g}; if no rate learns, " + _BROKEN,
        )
    if learns:
        return (
            "warn",
            f"{evidence}: train.lr={lr:g} barely moves the loss, {other_lr:g} does",
            "expected if train.lr is deliberately low (fine-tuning); otherwise raise train.lr",
        )
    return "fail", f"{evidence}: the loss does not fall at either rate", _BROKEN


def _overfit(job: Subject, lr: float) -> list[float]:
    """Losses of a fresh model trained on one small batch at ``lr``, until it memorises the batch,
    clearly diverges, or runs out of steps or time."""
    run, batch = _Run(job), small_batch(job)
    warmup = min(job.cfg.train.warmup_steps, OVERFIT_WARMUP)
    deadline = time.perf_counter() + OVERFIT_MAX_SECONDS
    losses: list[float] = []
    for step in range(OVERFIT_MAX_STEPS):
        losses.append(run.step(batch, lr * min(1.0, (step + 1) / warmup) if warmup else lr))
        if _outcome(losses) in ("memorised", "diverged") or time.perf_counter() > deadline:
            break
    return losses


def _outcome(losses: list[float]) -> str:
    start, end = losses[0], losses[-1]
    finished = len(losses) >= OVERFIT_MAX_STEPS
    if not math.isfinite(end) or end > OVERFIT_DIVERGED_RATIO * start or (finished and end > start):
        return "diverged"
    if end <= OVERFIT_PASS_RATIO * start:
        return "memorised"
    return "slow" if end <= OVERFIT_STUCK_RATIO * start else "stuck"


def _trajectory(lr: float, losses: list[float]) -> str:
    start, end = losses[0], losses[-1]
    cut = len(losses) < OVERFIT_MAX_STEPS and _outcome(losses) in ("slow", "stuck")
    return (
        f"at train.lr={lr:g} the loss went {start:.3f} -> {end:.4g} ({_ratio(end, start)}) in {len(losses)} steps"
        + (f" (stopped at the {OVERFIT_MAX_SECONDS:g} s limit)" if cut else "")
    )


# -- input pipeline ---------------------------------------------------------------------------------


def check_input_pipeline(job: Subject):
    if blocker := model_blocker(job):
        return "skip", blocker, ""
    cfg = job.cfg
    workers, size = cfg.data.num_workers, min(job.micro_batch_size, dataset_len(_train_data(job)))
    run = _Run(job)
    batches = iter(_loader(job, size, workers))
    waits, computes = [], []
    for step in range(PIPELINE_STEPS + 1):
        t0 = time.perf_counter()
        batch = to_device(next(batches), job.device)
        t1 = time.perf_counter()
        run.step(batch, _rate(step, cfg.train))  # reading the loss waits for the device
        waits.append(t1 - t0)
        computes.append(time.perf_counter() - t1)
    del batches  # stops the workers
    wait, compute = float(np.mean(waits[1:])), float(np.mean(computes[1:]))
    load = _load_seconds(job, size)
    share = wait / (wait + compute)
    ratio = load / compute
    recommended = 0 if ratio < LOAD_NEGLIGIBLE else math.ceil(ratio) + 1
    evidence = (
        f"waiting for data {share:.0%} of a step: {_ms(wait)} waiting, {_ms(compute)} computing per step "
        f"(mean of {PIPELINE_STEPS} steps of {size} items after the first, which took {_ms(waits[0])} to get "
        f"its batch) with data.num_workers={workers}; loading a batch in-process takes {_ms(load)}, so "
        f"recommended data.num_workers={recommended}"
    )
    if share > PIPELINE_WAIT_WARN:
        cores = os.cpu_count() or 1
        more = (
            (
                f" (more than the {cores} CPU cores: worth it when loading waits on I/O; when it computes, make "
                "__getitem__ cheaper, e.g. tokenize ahead of time)"
            )
            if recommended > cores
            else ""
        )
        return (
            "warn",
            evidence,
            (f"set data.num_workers={recommended} so that workers prepare batches while the model computes{more}"),
        )
    return "pass", evidence, ""


def _loader(job: Subject, size: int, workers: int):
    return make_train_loader(
        _train_data(job),
        schedule=size,
        seed=job.cfg.train.seed,
        start_step=0,
        num_workers=workers,
        pin_memory=job.device.type == "cuda",
        collate_fn=job.collate_fn,
    )


def _load_seconds(job: Subject, size: int, batches: int = 2) -> float:
    """Seconds to read and collate one batch in this process, the work a worker does per batch."""
    it = iter(_loader(job, size, 0))
    next(it)  # the first batch pays for opening memory maps and the like
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches


# -- determinism --------------------------------------------------------------------------------------


_DETERMINISM_FIX = (
    "find what is not seeded: random numbers drawn outside torch (Python's random, numpy, time) in "
    "the model, loss or dataset, or a data order that is not a function of the seed; "
    "torch.use_deterministic_algorithms(True) names nondeterministic kernels (on a GPU also set "
    "CUBLAS_WORKSPACE_CONFIG=:4096:8)"
)


def check_determinism(job: Subject):
    if blocker := model_blocker(job):
        return "skip", blocker, ""
    (losses_a, weights_a), (losses_b, weights_b) = _short_run(job), _short_run(job)
    shown = f"losses {_losses(losses_a)} and {_losses(losses_b)}"
    setup = (
        f"2 runs of {DETERMINISM_STEPS} steps from train.seed={job.cfg.train.seed} "
        f"with data.num_workers={job.cfg.data.num_workers}"
    )
    if [x.hex() for x in losses_a] == [x.hex() for x in losses_b]:
        if weights_a == weights_b:
            return "pass", f"{setup}: identical losses {_losses(losses_a)} and identical weights", ""
        return "warn", f"{setup}: identical losses but the weights differ after the last step", _DETERMINISM_FIX
    diff = max(abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in zip(losses_a, losses_b, strict=True))
    step = next(i for i, (a, b) in enumerate(zip(losses_a, losses_b, strict=True)) if a.hex() != b.hex()) + 1
    evidence = f"{setup}: {shown} first differ at step {step} (relative difference up to {diff:.1e})"
    if diff <= DETERMINISM_NOISE:
        return "warn", evidence + ": rounding-level, from kernels that sum in varying order", _DETERMINISM_FIX
    return "fail", evidence, _DETERMINISM_FIX


def _short_run(job: Subject) -> tuple[list[float], str]:
    t = job.cfg.train
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    run = _Run(job)
    size = min(SMALL_BATCH, job.micro_batch_size, dataset_len(_train_data(job)))
    batches = iter(_loader(job, size, job.cfg.data.num_workers))
    losses = [run.step(to_device(next(batches), job.device), _rate(s, t)) for s in range(DETERMINISM_STEPS)]
    del batches
    digest = hashlib.blake2b(digest_size=16)
    # The state dict's plain tensors: a QLoRA base is quantized, and gives its values there.
    for p in run.model.state_dict().values():
        digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return losses, digest.hexdigest()


CHECKS = [
    ("model", "initial loss", check_initial_loss),
    ("model", "gradient flow", check_gradient_flow),
    ("model", "gradient norms", check_gradient_norms),
    ("model", "single-batch overfit", check_overfit),
    ("pipeline", "input pipeline", check_input_pipeline),
    ("determinism", "determinism", check_determinism),
]


# -- helpers --------------------------------------------------------------------------------------------


def _layer(name: str) -> str:
    """The layer a parameter belongs to: up to the first index of a repeated layer
    ('blocks.3.attn.wq.weight' -> 'blocks.3'), else its module ('tok_emb.weight' -> 'tok_emb')."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[: index + 1] if index is not None else parts[:-1]) or name


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _names(names: list[str], shown: int = 6) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _ratio(end: float, start: float) -> str:
    return f"{end / start:.1%}" if math.isfinite(end) and start else "n/a"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _losses(losses: list[float]) -> str:
    return "[" + ", ".join(f"{x:.6f}" for x in losses) + "]"
