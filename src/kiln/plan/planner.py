"""``kiln plan``: the device a config is planned for, the setup it asks for, the estimate and,
when it does not fit, what would."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Literal

import torch

from kiln.config import Config, ConfigError
from kiln.device import DATASHEET_MEMORY, PEAK_FLOPS, gpu_key
from kiln.distributed.parallelize import check_layout
from kiln.distributed.pipeline import stage_layers
from kiln.distributed.world import World
from kiln.plan.estimate import (
    COMPUTE_EFFICIENCY,
    COMPUTE_EFFICIENCY_BY_GPU,
    FP32_TIME,
    GPUS_PER_NODE,
    LINK_EFFICIENCY,
    LINKS,
    NETWORK_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    PCIE_BYTES_PER_S,
    Cluster,
    MemoryEstimate,
    ModelShape,
    Setup,
    StepTime,
    Target,
    Workload,
)
from kiln.plan.recommend import Recommendation, largest_fitting_micro_batch, needs_fixed_micro_batch, recommend
from kiln.train.jobs import job_for

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
    cpu), else its CPU. Memory: --device-memory, else the local GPU's, else the named GPU's
    datasheet's, else the machine's RAM."""
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
    elif key is not None:
        name, memory, source = key, DATASHEET_MEMORY[key], f"the {key}'s datasheet; --device-memory for another size"
    else:
        name, memory, source = "CPU", _host_memory(), "this machine's RAM"
    if device_memory is not None:
        memory, source = parse_memory(device_memory), f"--device-memory {device_memory}"
    return Target(
        "cuda" if key or local is not None else "cpu", name, memory, source, PEAK_FLOPS.get(key) if key else None
    )


def _check_positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError([f"{flag}: must be >= 1, got {value}"])


def resolve_world(world_size: int | None, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int, str]:
    """The world size, the GPUs of a node, and the options that set the world size (for errors).
    Any two of --world-size, --nodes and --gpus-per-node give the third; --nodes alone means
    nodes of 8 GPUs, --gpus-per-node alone one such node, --world-size alone nodes of 8 (or one
    node of fewer); none of them one device."""
    for flag, value in (("--world-size", world_size), ("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        _check_positive(flag, value)
    if nodes is not None and gpus_per_node is not None:
        world = nodes * gpus_per_node
        if world_size is not None and world_size != world:
            raise ConfigError(
                [
                    f"--world-size: {world_size} is not --nodes {nodes} x --gpus-per-node {gpus_per_node} = {world}; "
                    "give two of the three"
                ]
            )
        return world, gpus_per_node, "--world-size" if world_size is not None else "--nodes x --gpus-per-node"
    if nodes is not None:
        if world_size is None:
            return nodes * GPUS_PER_NODE, GPUS_PER_NODE, "--nodes"
        if world_size % nodes:
            raise ConfigError([f"--world-size: {world_size} GPUs do not split evenly over --nodes {nodes}"])
        return world_size, world_size // nodes, "--world-size"
    per_node = gpus_per_node or GPUS_PER_NODE
    world = world_size or gpus_per_node or 1
    if world > per_node and world % per_node:
        where = f"--gpus-per-node {per_node}" if gpus_per_node else f"{per_node} GPUs (the default; --gpus-per-node)"
        raise ConfigError([f"--world-size: {world} GPUs do not fill whole nodes of {where}"])
    return world, per_node, "--world-size" if world_size is not None else "--gpus-per-node"


def parse_bandwidth(items: str | list[str] | None) -> dict[str, float]:
    """Bytes/s per link from "nvlink=360,network=40" (GB/s, 10^9 bytes/s, per GPU and direction;
    one or more --bandwidth options). Raises ConfigError naming --bandwidth."""
    if items is None:
        return {}
    out = {}
    for item in [items] if isinstance(items, str) else items:
        for part in item.split(","):
            key, _, value = (x.strip() for x in part.partition("="))
            try:
                rate = float(value)
            except ValueError:
                rate = -1.0
            if key.lower() not in LINKS or not 0 < rate < float("inf"):
                raise ConfigError(
                    [
                        f"--bandwidth: {part.strip()!r} is not LINK=GB/s with LINK one of {', '.join(LINKS)} "
                        "and a rate above 0, e.g. --bandwidth nvlink=360,network=40"
                    ]
                )
            out[key.lower()] = rate * 1e9
    return out


def resolve_cluster(
    target: Target, gpus_per_node: int, bandwidth: dict[str, float], efficiency: float | None
) -> Cluster:
    """The links and compute efficiency to plan with: the options given, else defaults for the
    target's GPU (80% of the nominal link rates, what NCCL's collectives reach)."""
    key = gpu_key(target.name) if target.kind == "cuda" else None
    nominal = NVLINK_BYTES_PER_S[key or "H100"]  # every PEAK_FLOPS key (what gpu_key returns) has an entry
    link = "NVLink" if nominal > 100e9 else "PCIe 5.0 x16 link"
    who = key or "H100 (no figures for this device)"
    defaults = {
        "nvlink": (LINK_EFFICIENCY * nominal, f"{LINK_EFFICIENCY:.0%} of {who} {link}'s {nominal / 1e9:g} GB/s"),
        "network": (
            LINK_EFFICIENCY * NETWORK_BYTES_PER_S,
            f"{LINK_EFFICIENCY:.0%} of a {NETWORK_BYTES_PER_S * 8 / 1e9:g} Gb/s NIC per GPU",
        ),
        "pcie": (PCIE_BYTES_PER_S, "host <-> GPU copies"),
    }
    rates, sources = {}, []
    for name, (default, why) in defaults.items():
        given = name in bandwidth
        rates[name] = bandwidth.get(name, default)
        sources.append((name, "--bandwidth" if given else f"default: {why}"))
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ConfigError([f"--compute-efficiency: must be above 0 and at most 1, got {efficiency}"])
    if efficiency is None:
        efficiency = COMPUTE_EFFICIENCY_BY_GPU.get(key, COMPUTE_EFFICIENCY) if key is not None else COMPUTE_EFFICIENCY
        sources.append(("efficiency", f"default for {key or 'this device'}"))
    else:
        sources.append(("efficiency", "--compute-efficiency"))
    return Cluster(gpus_per_node, **rates, efficiency=efficiency, sources=tuple(sources))


@dataclass
class Plan:
    config: Config
    job: Workload
    base: Setup
    auto_micro: bool  # train.micro_batch_size = "auto": base has the largest that fits (or 1)
    memory: MemoryEstimate
    time: StepTime
    recommendations: list[Recommendation]
    notes: list[str]

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.job.target.memory

    @property
    def searched(self) -> bool:
        """Whether kiln plan searched for setups: when the config does not fit, or runs on
        more than one device (where the layout matters)."""
        return not self.fits or self.base.world_size > 1


def _check_layout(cfg: Config, shape: ModelShape, target: Target, world_size: int, world_flag: str) -> None:
    """What kiln train would refuse of the layout (kiln.distributed): a world that pp x tp does
    not divide, a pipeline the model cannot be cut into, tensor, expert or context parallelism
    that it cannot take or the data-parallel ranks cannot hold, DDP with tensor parallelism, CPU
    offload without FSDP or from a CPU."""
    p = cfg.parallel
    if world_size % (p.tp * p.pp):
        of = f"parallel.tp = {p.tp}" if p.pp == 1 else f"parallel.pp x parallel.tp = {p.pp} x {p.tp} = {p.pp * p.tp}"
        raise ConfigError([f"{world_flag}: {world_size} is not a multiple of {of}"])
    if p.pp > 1:
        if shape.pipeline_error:
            raise ConfigError([shape.pipeline_error])
        stage_layers(shape.n_layer, p.pp_stages, p.pp_layers)
    world = World(size=world_size, tp=p.tp, pp=p.pp, device=torch.device(target.kind))
    check_layout(shape.plan, world, p, f"model.family={cfg.model.family}")


def _base_setup(cfg: Config, world_size: int, world_flag: str) -> Setup:
    t, p = cfg.train, cfg.parallel
    dp = world_size // (p.tp * p.pp)
    data = dp // p.cp  # the ranks that read different batches
    batch = t.global_batch(data)  # "auto": the batch the run starts with
    if batch % data:
        split = f" / parallel.cp {p.cp}" if p.cp > 1 else ""
        raise ConfigError(
            [
                f"train.global_batch_size: {batch} is not divisible by the {data} data-parallel ranks "
                f"({world_flag} {world_size} / parallel.pp {p.pp} / parallel.tp {p.tp}{split}); use a multiple of "
                f"{data}, or larger parallel.tp, parallel.pp or parallel.cp"
            ]
        )
    micro = t.micro_batch_size
    if micro != "auto" and (batch // data) % micro:
        raise ConfigError(
            [
                f"train.micro_batch_size: {micro} does not divide each rank's share of the global "
                f"batch, {batch} / {data} data-parallel ranks; use a divisor of "
                f"{batch // data}, or auto (kiln plan shows the largest that fits)"
            ]
        )
    # The config has checked the pipeline's micro-batches (they divide a fixed micro-batch);
    # the Setup keeps their number, 0 meaning one per stage resolved.
    return Setup(
        1 if micro == "auto" else micro,
        t.precision,
        # Selective checkpointing keeps most of a block's activations (its products' outputs):
        # its memory estimated as none's, which bounds it from above; its time with SELECTIVE_TIME.
        t.activation_checkpointing is True,
        p.strategy,
        p.cpu_offload,
        world_size,
        p.tp,
        p.pp,
        p.pp_schedule,
        p.microbatches if p.pp > 1 else p.pp_microbatches,
        p.pp_virtual_stages,
        pp_layers=p.pp_layers if p.pp > 1 else (),
        ep=p.ep,
        cp=p.cp,
        dp_replicate=p.dp_replicate,
        optimizer=t.optimizer,
        compiled=t.compile is True and not t.compile_after,
        compiled_steps=t.compile is True,
        selective=t.activation_checkpointing == "selective",
    )


def make_plan(
    cfg: Config,
    *,
    world_size: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    device_memory: str | None = None,
    gpu: str | None = None,
    bandwidth: str | list[str] | None = None,
    compute_efficiency: float | None = None,
    top: int = 3,
) -> Plan:
    """Estimate ``cfg`` on its devices (``world_size``, or ``nodes`` x ``gpus_per_node``), and
    the fastest setups that fit: when it does not fit, or on more than one device. Bad input
    raises ConfigError naming the option or key."""
    world, per_node, world_flag = resolve_world(world_size, nodes, gpus_per_node)
    _check_positive("--top", top)
    links = parse_bandwidth(bandwidth)
    target = resolve_target(cfg.run.device, gpu, device_memory)
    cluster = resolve_cluster(target, per_node, links, compute_efficiency)
    if cfg.train.precision == "auto":  # as on the GPUs of PEAK_FLOPS, which all compute bf16 natively
        precision: Literal["bf16", "fp32"] = "bf16" if target.kind == "cuda" else "fp32"
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    built = job_for(cfg)
    compile_auto = cfg.train.compile == "auto"
    family, cfg = built.family, dataclasses.replace(cfg, train=built.cfg.train)  # compile = "auto" resolved
    args = family.resolve(cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
    shape = ModelShape.of(family, args, cfg)
    _check_layout(cfg, shape, target, world, world_flag)
    base = dataclasses.replace(_base_setup(cfg, world, world_flag), compile_auto=compile_auto)
    # global_batch_size = "auto" is planned at the batch the run starts with.
    job = Workload(shape, cfg.data.seq_len, cfg.train.global_batch(base.data_ranks), target, cluster)
    auto_micro = cfg.train.micro_batch_size == "auto"
    if auto_micro:
        base = largest_fitting_micro_batch(job, base) or base
    memory = job.memory(base)
    plan = Plan(cfg, job, base, auto_micro, memory, job.time(base), [], _notes(cfg, base, job, auto_micro))
    if plan.searched:
        plan.recommendations = recommend(job, base, auto_micro, limit=top)
    return plan


def _notes(cfg: Config, s: Setup, job: Workload, auto_micro: bool) -> list[str]:
    target, notes = job.target, []
    if auto_micro and needs_fixed_micro_batch(s):
        notes.append(
            "train.micro_batch_size=auto needs one process or DDP; with FSDP, tensor or pipeline parallelism "
            f"over several ranks set a number: train.micro_batch_size={s.micro_batch_size} is the largest "
            "that fits"
        )
    if cfg.data.tokenizer != "bpe":
        notes.append(
            f"data.tokenizer is a file ({cfg.data.tokenizer}); kiln plan does not read it and takes the "
            f"vocabulary from data.vocab_size = {cfg.data.vocab_size}: set that to the tokenizer's size"
        )
    if s.compiled and cfg.train.precision == "fp8":
        notes.append(
            "train.precision=fp8's casts are not modelled: the memory estimate is an upper bound (a "
            "compiled fp8 run of the 1b preset peaked at 0.56 of it)"
        )
    elif s.compiled and not job.shape.memory.counts_compiled:
        notes.append(
            f"the {job.shape.family.name} family's memory model counts eager autograd's activations: "
            "for this compiled run the estimate is an upper bound"
        )
    if job.shape.created_whole and s.splits:
        why = (
            "lora.quantize_base=nf4 quantizes the base whole"
            if cfg.lora.quantize_base != "none"
            else f"the {job.shape.family.name} family's model does not give each tensor's starting values by name"
        )
        notes.append(f"every rank creates the whole model before it is split ({why}): the setup phase counts it")
    if target.kind == "cuda" and target.peak_flops is None:
        notes.append(f"{target.name}: no peak FLOP/s in kiln/device.py PEAK_FLOPS, so no time estimate")
    if job.shape.plan.experts and target.peak_flops and job.cluster.source("efficiency").startswith("default"):
        notes.append(
            "a mixture of experts is timed at a dense model's compute efficiency, which published runs of one "
            "do not reach (torchtitan's Qwen3-30B-A3B: 10-15% of the peak; docs/plan.md): "
            "--compute-efficiency 0.15 is nearer"
        )
    if target.kind == "cuda" and s.precision == "fp32":
        notes.append(
            "train.precision=fp32 runs matmuls without the bf16 tensor-core rate (PyTorch keeps TF32 off): "
            f"the time estimate counts it {FP32_TIME:g}x slower"
        )
    if s.tp > job.cluster.gpus_per_node:
        notes.append(
            f"parallel.tp = {s.tp} spans nodes of {job.cluster.gpus_per_node} GPUs: its all-reduces, in every "
            "block, go over the network"
        )
    return notes
