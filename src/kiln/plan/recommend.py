"""What to change when a config does not fit: every combination of the settings a plan may
change, estimated, and the cheapest few that fit, each with what it costs in words."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.plan.estimate import STRATEGY_TIME, Job, MemoryEstimate, Setup, offload_seconds


@dataclass
class Recommendation:
    setup: Setup
    overrides: list[str]  # --set items
    memory: MemoryEstimate
    seconds: float  # estimated time per step (rules of thumb)
    time_factor: float  # relative to the config as given
    costs: list[str]  # what each change costs, in words


def _candidates(job: Job, base: Setup, world_size: int, auto_micro: bool) -> Iterator[Setup]:
    """Every combination of the changes a plan may recommend, for ``world_size`` devices."""
    gpu = job.target.kind == "cuda"
    dp = world_size // base.tp
    precisions = {base.precision, "bf16"} if gpu and base.precision == "fp32" else {base.precision}
    if dp > 1:
        layouts = [
            (strategy, offload)
            for strategy in ("ddp", "fsdp_grad_op", "fsdp")
            for offload in ((False, True) if gpu and strategy != "ddp" else (False,))
            if not (strategy == "ddp" and base.tp > 1)
        ]
    else:  # one data-parallel rank: FSDP matters only to offload
        layouts = [(base.strategy, False)] + [("fsdp", True)] * gpu
    for precision, checkpointing, (strategy, offload) in itertools.product(
        sorted(precisions), sorted({base.activation_checkpointing, True}), layouts
    ):
        s = dataclasses.replace(
            base,
            precision=precision,
            activation_checkpointing=checkpointing,
            strategy=strategy,
            cpu_offload=offload,
            world_size=world_size,
        )
        if auto_micro:  # the run will pick its micro-batch: the largest that fits
            fitting = largest_fitting_micro_batch(job, s)
            if fitting:
                yield fitting
        else:
            for micro in job.micro_batch_options(s):
                yield dataclasses.replace(s, micro_batch_size=micro)


def largest_fitting_micro_batch(job: Job, s: Setup) -> Setup | None:
    for micro in reversed(job.micro_batch_options(s)):
        candidate = dataclasses.replace(s, micro_batch_size=micro)
        if job.fits(candidate):
            return candidate
    return None


def needs_fixed_micro_batch(s: Setup) -> bool:
    """kiln probes for train.micro_batch_size = "auto" only without collectives in the forward
    pass: in one process or under DDP, not with FSDP or tensor parallelism over several ranks."""
    return s.world_size > 1 and (s.strategy != "ddp" or s.tp > 1)


def _recommendation(job: Job, base: Setup, s: Setup, auto_micro: bool) -> Recommendation:
    overrides = s.overrides(base)
    if auto_micro:  # the run finds the micro-batch itself, where it can
        overrides = [o for o in overrides if not o.startswith("train.micro_batch_size=")]
        if needs_fixed_micro_batch(s):
            overrides.insert(0, f"train.micro_batch_size={s.micro_batch_size}")
    seconds = job.seconds(s)
    return Recommendation(
        s, overrides, job.memory(s), seconds, seconds / job.seconds(base), _costs(job, base, s, auto_micro)
    )


def _costs(job: Job, base: Setup, s: Setup, auto_micro: bool) -> list[str]:
    costs = []
    accumulation = job.rank_batch(s) // s.micro_batch_size
    if auto_micro:
        costs.append(f"micro-batch auto: {s.micro_batch_size} fits ({accumulation} per rank and step)")
    elif s.micro_batch_size < base.micro_batch_size:
        costs.append(
            f"micro-batch {base.micro_batch_size} -> {s.micro_batch_size} ({accumulation} per rank and "
            "step): the same compute in smaller matmuls, which run less efficiently"
        )
    elif s.micro_batch_size > base.micro_batch_size:
        costs.append(
            f"micro-batch {base.micro_batch_size} -> {s.micro_batch_size} ({accumulation} per rank and "
            "step): fewer, larger micro-batches"
        )
    if s.activation_checkpointing and not base.activation_checkpointing:
        costs.append("activation checkpointing recomputes each block's forward: about +33% compute")
    if s.precision != base.precision:
        costs.append("bf16 autocast runs the matmuls on the tensor cores: faster (numerics change slightly)")
    if s.strategy != base.strategy and s.dp > 1:
        costs.append(
            f"{s.strategy} shards state over the {s.dp} data-parallel ranks: more communication, "
            f"mostly overlapped (about +{round(100 * (STRATEGY_TIME[s.strategy] - 1))}%)"
        )
    if s.offload:
        extra = offload_seconds(job.shape, s, job.rank_batch(s) // s.micro_batch_size)
        costs.append(
            "CPU offload copies parameters and gradients over PCIe every micro-batch and runs AdamW "
            f"on the CPU: about +{extra:.1f} s per step"
        )
    return costs


def recommend(job: Job, base: Setup, auto_micro: bool, limit: int = 3) -> list[Recommendation]:
    """The cheapest setups that fit (by estimated step time, then fewest changes), each not
    merely adding changes to one listed before it; then the fewest GPUs that fit with fsdp."""
    fitting = [s for s in _candidates(job, base, base.world_size, auto_micro) if s != base and job.fits(s)]
    fitting.sort(key=lambda s: (job.seconds(s), len(s.overrides(base))))
    chosen: list[Recommendation] = []
    for s in fitting:
        rec = _recommendation(job, base, s, auto_micro)
        changed = {item.split("=")[0] for item in rec.overrides}
        if rec.overrides and not any({i.split("=")[0] for i in c.overrides} <= changed for c in chosen):
            chosen.append(rec)
        if len(chosen) == limit:
            break
    more_gpus = _fewest_gpus(job, base, auto_micro)
    return chosen + ([more_gpus] if more_gpus else [])


def _fewest_gpus(job: Job, base: Setup, auto_micro: bool, most: int = 4096) -> Recommendation | None:
    """The smallest power-of-two multiple of the world size that fits with fsdp (no offload)."""
    if job.target.kind != "cuda":
        return None
    world = base.world_size * 2
    while world <= most:
        if job.global_batch % (world // base.tp) == 0:
            options = [
                s
                for s in _candidates(job, dataclasses.replace(base, strategy="fsdp"), world, auto_micro)
                if s.strategy == "fsdp" and not s.cpu_offload and job.fits(s)
            ]
            if options:
                return _recommendation(job, base, min(options, key=job.seconds), auto_micro)
        world *= 2
    return None
