"""``kiln plan``: the device a config is planned for, the setup it asks for, the estimate and,
when it does not fit, what would."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch

from kiln.config import Config, ConfigError
from kiln.device import PEAK_FLOPS, gpu_key
from kiln.models.family import family_of
from kiln.plan.estimate import FP32_TIME, Job, MemoryEstimate, ModelShape, Setup, Target
from kiln.plan.recommend import Recommendation, largest_fitting_micro_batch, needs_fixed_micro_batch, recommend

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(text: str) -> int:
    """Bytes in "80GB" (10^9), "80GiB" (2^30), "24G" (a bare letter is binary, as in Slurm or
    Docker), "512MB" or a plain number of bytes. Raises ConfigError naming --device-memory."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not match or match.group(2) not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(
            [f"--device-memory: {text!r} is not a memory size; use e.g. 80GB, 80GiB, 24G, 512MB or a number of bytes"]
        )
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_target(run_device: str, gpu: str | None, device_memory: str | None) -> Target:
    """The device to plan for: the named GPU, else this machine's GPU (unless run.device is
    cpu), else its CPU. Memory: --device-memory, else the local GPU's, else the machine's RAM."""
    local = None
    if run_device != "cpu" and torch.cuda.is_available():
        local = torch.device(run_device if run_device.startswith("cuda:") else "cuda:0")
    key = None
    if gpu is not None:
        key = gpu_key(gpu)
        if key is None:
            raise ConfigError(
                [
                    f"--gpu: {gpu!r} is not a GPU kiln knows the peak of; choose one of "
                    f"{', '.join(PEAK_FLOPS)} (kiln/device.py)"
                ]
            )
    if local is not None and (key is None or gpu_key(torch.cuda.get_device_name(local)) == key):
        name = torch.cuda.get_device_name(local)
        memory, source = torch.cuda.get_device_properties(local).total_memory, f"{local}, {name}"
        key = gpu_key(name)
    else:
        name = key or "CPU"
        memory, source = _host_memory(), "this machine's RAM" + (" (no such GPU here)" if key else "")
    if device_memory is not None:
        memory, source = parse_memory(device_memory), f"--device-memory {device_memory}"
    return Target(
        "cuda" if key or local is not None else "cpu", name, memory, source, PEAK_FLOPS.get(key) if key else None
    )


@dataclass
class Plan:
    config: Config
    job: Job
    base: Setup
    auto_micro: bool  # train.micro_batch_size = "auto": base has the largest that fits (or 1)
    memory: MemoryEstimate
    recommendations: list[Recommendation]
    notes: list[str]

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.job.target.memory


def _base_setup(cfg: Config, world_size: int) -> Setup:
    t, p = cfg.train, cfg.parallel
    if world_size < 1:
        raise ConfigError([f"--world-size: must be >= 1, got {world_size}"])
    if world_size % p.tp:
        raise ConfigError([f"--world-size: {world_size} is not a multiple of parallel.tp = {p.tp}"])
    dp = world_size // p.tp
    if t.global_batch_size % dp:
        raise ConfigError(
            [
                f"train.global_batch_size: {t.global_batch_size} is not divisible by the {dp} "
                "data-parallel ranks (--world-size / parallel.tp)"
            ]
        )
    micro = t.micro_batch_size
    if micro != "auto" and (t.global_batch_size // dp) % micro:
        raise ConfigError(
            [
                f"train.micro_batch_size: {micro} does not divide each rank's share of the global "
                f"batch, {t.global_batch_size} / {dp} data-parallel ranks"
            ]
        )
    if dp > 1 and p.strategy == "ddp" and p.tp > 1:
        raise ConfigError(["parallel.strategy: ddp cannot be combined with parallel.tp > 1; use fsdp or fsdp_grad_op"])
    if dp > 1 and p.strategy == "ddp" and p.cpu_offload:
        raise ConfigError(["parallel.cpu_offload: needs parallel.strategy fsdp or fsdp_grad_op"])
    return Setup(
        1 if micro == "auto" else micro,
        t.precision,
        t.activation_checkpointing,
        p.strategy,
        p.cpu_offload,
        world_size,
        p.tp,
    )


def make_plan(cfg: Config, *, world_size: int = 1, device_memory: str | None = None, gpu: str | None = None) -> Plan:
    """Estimate ``cfg`` on ``world_size`` devices, and what to change if it does not fit.
    Bad input raises ConfigError naming the option or key."""
    target = resolve_target(cfg.run.device, gpu, device_memory)
    if cfg.train.precision == "auto":  # as on the GPUs of PEAK_FLOPS, which all compute bf16 natively
        precision = "bf16" if target.kind == "cuda" else "fp32"
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    base = _base_setup(cfg, world_size)
    family = family_of(cfg.model)
    args = family.resolve(cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
    family.parallel_plan(args).check_tensor_parallel(base.tp, f"model.family={cfg.model.family}")
    job = Job(ModelShape.of(family, args), cfg.data.seq_len, cfg.train.global_batch_size, target)
    auto_micro = cfg.train.micro_batch_size == "auto"
    if auto_micro:
        base = largest_fitting_micro_batch(job, base) or base
    memory = job.memory(base)
    recommendations = [] if memory.total <= target.memory else recommend(job, base, auto_micro)
    return Plan(cfg, job, base, auto_micro, memory, recommendations, _notes(cfg, base, target, auto_micro))


def _notes(cfg: Config, s: Setup, target: Target, auto_micro: bool) -> list[str]:
    notes = []
    if auto_micro and needs_fixed_micro_batch(s):
        notes.append(
            "train.micro_batch_size=auto needs one process or DDP; with FSDP or tensor parallelism over "
            f"several ranks set a number: train.micro_batch_size={s.micro_batch_size} is the largest "
            "that fits"
        )
    if cfg.data.tokenizer != "bpe":
        notes.append(
            f"data.tokenizer is a file ({cfg.data.tokenizer}); kiln plan does not read it and takes the "
            f"vocabulary from data.vocab_size = {cfg.data.vocab_size}: set that to the tokenizer's size"
        )
    if cfg.train.compile:
        notes.append(
            "train.compile=true is not modelled: the estimate is for the eager step (a compiled one "
            "usually keeps fewer activations)"
        )
    if s.cpu_offload and not s.sharded:
        notes.append("parallel.cpu_offload needs parallel.strategy fsdp or fsdp_grad_op: planned without offload")
    if target.kind == "cuda" and target.peak_flops is None:
        notes.append(f"{target.name}: no peak FLOP/s in kiln/device.py PEAK_FLOPS, so no time estimate")
    if target.kind == "cuda" and s.precision == "fp32":
        notes.append(
            "train.precision=fp32 runs matmuls without the bf16 tensor-core rate (PyTorch keeps TF32 off): "
            f"the time estimate counts it {FP32_TIME:g}x slower"
        )
    return notes
