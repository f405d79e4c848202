"""The memory each device needs for a training step, and the step's time, before anything is
allocated.

The model is built on the ``meta`` device (shapes, no storage), with the run's LoRA adapters
injected, so the parameter, gradient and optimizer-state bytes are counted from the real
parameter list (what trains, and a frozen base as the run stores it), split and sharded as the
family's parallel plan and the setup say. What the model keeps for its backward pass comes from
its family's memory model (``kiln.models.MemoryModel``): kiln's GPT counts it tensor by tensor,
checked against live-tensor measurements of real training steps (tests/plan/test_plan.py). A
step's memory is followed through its phases (end of forward, backward of the output layer, of
the last and the first block, of the embedding, the optimizer step) on the first and the last
pipeline stage, and the plan reports the largest. A rank's host memory from its start through
its first step (building, initialising or loading its shards, the step) is counted beside it.

A step's time is the busiest rank's compute at an assumed fraction of the device's peak, plus
what compute does not hide: tensor-parallel all-reduces, expert-parallel all-to-alls,
context-parallel all-gathers of keys and values, the part of FSDP's or DDP's collectives beyond
the compute they overlap, pipeline sends, and the pipeline's bubble. Each collective is costed
as a ring over the link its group spans: NVLink inside a node, the network between nodes.
Everything below that says "rule of thumb" or "assumed" is an assumption, not a measurement;
docs/plan.md lists them and compares the estimates with published step times.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import nn

from kiln.config import Config, ConfigError, TrainConfig
from kiln.device import PEAK_FLOPS
from kiln.distributed.parallel import host_units
from kiln.models.family import MemoryContext, MemoryModel, ModelFamily, ParallelPlan
from kiln.observe.memory import GIB
from kiln.train.apply import NF4_BLOCK, NF4_SCALER_BLOCK, apply_lora
from kiln.train.optim import build_optimizer
from kiln.train.precision import DTYPES

if TYPE_CHECKING:
    from peft.tuners.tuners_utils import BaseTunerLayer

# Rules of thumb (docs/plan.md). What a GPU process holds beyond its tensors: the CUDA context,
# cuBLAS/cuDNN workspaces and kernel images, NCCL's buffers when there are peers, and the
# caching allocator's reserved-but-unallocated slack (fragmentation).
CUDA_CONTEXT_BYTES = GIB
NCCL_BYTES = GIB // 2
ALLOCATOR_SLACK = 0.10
# A rank's process on the host before its first tensor (resident set, measured on a 2-core CPU):
# Python, PyTorch and kiln imported 0.24 GB, and a run's own data and threads about 0.02 GB;
# transformers and peft, which a Hugging Face model or LoRA imports, 0.17 GB more (a kiln GPT
# LoRA run: 0.43 GB once its model is built on meta). On a GPU the CUDA runtime and its
# libraries are mapped into the process too (a rule of thumb, not measured).
PROCESS_BYTES = 260 * 10**6
HF_LIBRARIES_BYTES = 170 * 10**6
CUDA_HOST_BYTES = GIB
# QLoRA's NF4 weight (kiln.train.apply.quantize_base): 4-bit codes, an int8 scale per block of
# NF4_BLOCK weights and an fp32 factor per group of NF4_SCALER_BLOCK scales: 0.516 bytes a weight.
NF4_BYTES = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)

# The fraction of the dense bf16 peak a training step's kernels reach while nothing waits for
# communication (--compute-efficiency), from torchtitan's published runs (docs/plan.md): its
# eager Llama 3.1 8B on 8 H100s (at 500 W) reaches 34% MFU with selective recomputation, about
# 0.37 of the peak in the kernels; on A100s Llama 3 8B and 70B reach 52-58% MFU.
COMPUTE_EFFICIENCY = 0.40
COMPUTE_EFFICIENCY_BY_GPU = {"A100": 0.60}
RECOMPUTE_TIME = 4 / 3  # activation checkpointing runs each block's forward twice: 3 -> 4 units
# Selective checkpointing recomputes a block's norms, activation functions and elementwise
# products, memory-bound operations of a few percent of a step (a rule of thumb).
SELECTIVE_TIME = 1.05
# On a GPU, compiled steps run faster than eager ones: torchtitan's published Llama 3.1 8B on 8
# H100s goes from 5,762 to 6,667 tokens/s per GPU with torch.compile (kiln's own gpt2-124m, whose
# small kernels leave more to fuse, 1.83x: BENCHMARKS.md).
COMPILED_SPEEDUP = 6667 / 5762
# float8 matmuls (train.precision=fp8) against bf16, compiled: kiln's 1b preset on an H200 (BENCHMARKS.md).
FP8_SPEEDUP = 1.259
FULL_MICRO_TOKENS = 8192  # below this many tokens a micro-batch's matmuls lose efficiency:
SMALL_MICRO_TIME = 0.05  # this much more time per halving
# Tensor parallelism narrows each rank's matmuls: below this many columns (d_model / tp) they lose
# efficiency, SMALL_MICRO_TIME per halving as well (a rule of thumb; docs/plan.md's published
# tensor-parallel runs are within 15% with it).
FULL_WIDTH = 4096
FP32_TIME = 4.0  # fp32 matmuls skip the bf16 tensor-core rate (PyTorch keeps TF32 off)
CPU_ADAM_BYTES_PER_S = 10e9  # memory traffic of the AdamW step when it runs on the CPU
NOMINAL_PEAK_FLOPS = PEAK_FLOPS["H100"]  # orders recommendations when the device's peak is unknown

# Links (--bandwidth), in bytes/s per GPU and direction. NCCL's ring collectives move large
# messages at about 80% of a link's nominal rate (the "bus bandwidth" of nccl-tests), so the
# defaults are 80% of the nominal figures below.
LINK_EFFICIENCY = 0.8
# NVLink per GPU and direction: NVLink 4 (H100/H200 SXM) 18 links x 25 GB/s, NVLink 3 (A100
# SXM) 12 x 25, NVLink 5 (B200) 18 x 50. The PCIe and NVL H100s reach their node's other GPUs
# over PCIe 5.0 x16 (the NVL's NVLink bridge joins only pairs).
NVLINK_BYTES_PER_S = {
    "H100 PCIe": 64e9,
    "H100 NVL": 64e9,
    "H100": 450e9,
    "H200": 450e9,
    "B200": 900e9,
    "A100": 300e9,
}
NETWORK_BYTES_PER_S = 50e9  # a 400 Gb/s InfiniBand or RoCE NIC per GPU
PCIE_BYTES_PER_S = 25e9  # host <-> GPU copies of CPU offload (already an effective rate)
GPUS_PER_NODE = 8
LINKS = ("nvlink", "network", "pcie")


# ---------------------------------------------------------------------------------------------
# What is planned: the model's shapes, the knobs, the devices


class Param(NamedTuple):
    name: str  # within its block, or at the root; without ".weight"
    shape: tuple[int, ...]
    tp_dim: int | None  # the dimension tensor parallelism divides, or None
    kind: str = "trained"  # or "frozen" (a LoRA run's base), "nf4" (a QLoRA base's adapted weight)
    expert: bool = False  # a mixture of experts' weight, experts on dim 0: expert parallelism splits it


_SHAPES: dict[tuple[str, ...], ModelShape] = {}


@dataclass(frozen=True, eq=False)
class ModelShape:
    """Parameter shapes of a family's model, from the model built on the meta device, and what
    the family says of it: how it splits (its parallel plan), what it keeps (its memory model)."""

    family: ModelFamily
    args: Any
    block: tuple[Param, ...]  # one repeated layer's parameters
    root: tuple[Param, ...]  # the rest: embedding, final norm, output layer (a tied matrix once)
    buffer_bytes: int
    memory: MemoryModel
    plan: ParallelPlan
    # The root split at the blocks, as a pipeline's first and last stage hold it: a tied
    # embedding and output layer is in both (each stage keeps its own copy).
    before: tuple[Param, ...] = ()
    after: tuple[Param, ...] = ()
    pipeline_error: str | None = None  # why kiln cannot pipeline this model, or None
    # A block's FSDP units where ranks gather on the host (_host_units).
    host_units: tuple[tuple[Param, ...], ...] = ()
    # The blocks smaller than ``block`` (a mixture of experts' dense first layers) and how many:
    # the whole model's counts hold them as they are, a device's peak counts every block as ``block``.
    small_block: tuple[Param, ...] = ()
    small_blocks: int = 0
    lora: bool = False  # LoRA adapters train, the rest is frozen
    created_whole: bool = False  # every rank creates the whole model before splitting it
    imports_hf: bool = False  # the run imports transformers and peft

    @classmethod
    def of(cls, family: ModelFamily, args: Any, cfg: Config | None = None) -> ModelShape:
        """The shape of ``family``'s model for ``args``, with the LoRA adapters ``cfg`` asks for.
        Building a 70B-class model on the meta device takes about a second, so a process that
        plans one model again and again (tests, a script comparing clusters) builds it once."""
        lora = repr((cfg.lora, cfg.model.task)) if cfg is not None and cfg.lora.rank else ""
        key = (type(family).__module__, type(family).__qualname__, family.name, repr(args), lora)
        if key not in _SHAPES:
            if len(_SHAPES) >= 8:
                _SHAPES.pop(next(iter(_SHAPES)))
            _SHAPES[key] = cls._build(family, args, cfg if lora else None)
        return _SHAPES[key]

    @classmethod
    def _build(cls, family: ModelFamily, args: Any, lora_cfg: Config | None) -> ModelShape:
        with torch.device("meta"):
            model = family.build(args)
            if lora_cfg is not None:  # the run's own adapters, without storage
                model = apply_lora(model, lora_cfg, family, args, quantize=False)
        # As kiln.train.apply.quantize_base picks them: the weight each adapted layer wraps.
        nf4 = set()
        if lora_cfg is not None and lora_cfg.lora.quantize_base == "nf4":
            adapted = (cast("BaseTunerLayer", m) for m in model.modules() if hasattr(m, "lora_A"))
            nf4 = {id(layer.get_base_layer().weight) for layer in adapted}

        def param(name: str, p: torch.Tensor, tp_dim: int | None) -> Param:
            kind = "trained" if p.requires_grad else "nf4" if id(p) in nf4 else "frozen"
            # The experts module's own weights, as kiln.distributed.experts splits them.
            expert = bool(plan.experts) and name.rpartition(".")[0] == plan.experts
            return Param(name.removesuffix(".weight"), tuple(p.shape), tp_dim, kind, expert)

        plan = family.parallel_plan(args)
        blocks = plan.repeated_blocks(model)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        # Blocks that differ (a mixture of experts' dense first layers): a device's peak counts each
        # as the largest, erring towards more memory; the whole model's counts take both kinds.
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        largest = blocks[sizes.index(max(sizes))] if blocks else None
        block = (
            tuple(param(name, p, tp_split_dim(plan, largest, name)) for name, p in largest.named_parameters())
            if largest is not None
            else ()
        )
        small = [b for b, size in zip(blocks, sizes, strict=True) if size < max(sizes)]
        small_block = (
            tuple(param(name, p, tp_split_dim(plan, small[0], name)) for name, p in small[0].named_parameters())
            if small
            else ()
        )
        root = tuple(  # a tied matrix is listed once
            param(name, p, None) for name, p in model.named_parameters() if id(p) not in in_blocks
        )
        # A pipeline's first and last stage hold the modules the plan names for them, a tied
        # matrix a copy on each side (kiln.distributed.pipeline). Without such names: the
        # registration order, which puts the embedding before the blocks and the final norm and
        # output layer after them (what the output layer's FLOPs need).
        before, after, seen_block = [], [], False
        _, first, last = plan.pipeline_paths(model) if plan.pipelined else ("", {}, {})
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in in_blocks:
                seen_block = True
                continue
            entry = param(name, p, None)
            if plan.pipelined:
                before += [entry] * any(name.startswith(path + ".") for path in first.values())
                after += [entry] * any(name.startswith(path + ".") for path in last.values())
            else:
                (after if seen_block else before).append(entry)
        host_units = _host_units(largest, block) if largest else ()
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        pipeline_error = None if plan.pipelined else plan.pipeline_error(type(model).__name__)
        memory = family.memory_model(args)
        # As the job decides (kiln.train.jobs.base.Job.family_model): a 4-bit base is quantized
        # whole, and a family that cannot say each tensor's starting value by name creates the
        # whole model, on every rank (the seed does not change which).
        created_whole = bool(nf4) or family.initial_values(args, model, 0) is None
        return cls(
            family,
            args,
            block,
            root,
            buffers,
            memory,
            plan,
            tuple(before),
            tuple(after),
            pipeline_error,
            host_units,
            small_block=small_block,
            small_blocks=len(small),
            lora=lora_cfg is not None,
            created_whole=created_whole,
            imports_hf=lora_cfg is not None or family.transformers_model(model) is not None,
        )

    @property
    def n_layer(self) -> int:
        return self.memory.n_layer

    @property
    def kv_width(self) -> int:
        """Elements of a token's keys (and of its values), which context parallelism gathers: as
        the family's memory model says (kiln's GPT does), else d_model."""
        return self.memory.kv_width or self.memory.d_model

    @property
    def experts_per_token(self) -> int:
        """The copies of a token expert parallelism sends, one to each of its experts: as the
        family's memory model says (kiln's GPT does), else 1."""
        return self.memory.experts_per_token

    def num_params(self, kinds: tuple[str, ...] = ("trained", "frozen", "nf4")) -> int:
        """Parameters of the model (LoRA adapters included), or of the ``kinds`` named."""
        root = sum(math.prod(p.shape) for p in self.root if p.kind in kinds)
        large = (self.n_layer - self.small_blocks) * sum(math.prod(p.shape) for p in self.block if p.kind in kinds)
        return root + large + self.small_blocks * sum(math.prod(p.shape) for p in self.small_block if p.kind in kinds)

    def flops_per_token(self, seq_len: int) -> float:
        return self.family.flops_per_token(self.args, seq_len)

    @property
    def head_flops_per_token(self) -> float:
        """Training FLOPs per token of the matrices after the blocks (the output layer): 6 per
        weight, as in the family's count. They run on the pipeline's last stage, whole on every
        tensor-parallel rank unless the plan splits the loss by vocabulary (``head_split``)."""
        return 6.0 * sum(math.prod(p.shape) for p in self.after if len(p.shape) == 2)

    @property
    def head_split(self) -> bool:
        """Tensor parallelism splits the output layer and its loss by vocabulary (loss parallelism)."""
        return bool(self.plan.loss)

    def pipelines(self, stages: int) -> bool:
        """Whether kiln can cut the model into ``stages`` pipeline stages: its plan names the
        stages' modules, and the layers split evenly (kiln.distributed.pipeline)."""
        return self.pipeline_error is None and self.n_layer % stages == 0

    def splits(self, tp: int) -> bool:
        """Whether the family's plan can split the blocks over ``tp`` ranks (and kiln can: a
        QLoRA base's 4-bit blocks do not split, the config refuses them with tensor parallelism)."""
        if tp > 1 and any(p.kind == "nf4" for p in (*self.block, *self.root)):
            return False
        try:
            self.plan.check_tensor_parallel(tp, "")
        except ConfigError:
            return False
        return True


def tp_split_dim(plan: ParallelPlan, block: nn.Module, name: str) -> int | None:
    """The dimension of a parameter of ``block`` (one of the repeated layers) that the family's
    tensor-parallel styles divide among the ranks, or None if it stays whole: a column-wise linear
    layer's rows (its outputs) and bias, a row-wise one's columns. ``name`` is relative to the
    block (``attn.wq.weight``)."""
    if plan.tensor_parallel is None:
        return None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    module, _, leaf = name.rpartition(".")
    style = plan.tensor_parallel(block).get(module)
    if isinstance(style, ColwiseParallel):
        return 0
    return 1 if isinstance(style, RowwiseParallel) and leaf == "weight" else None


def _host_units(block: nn.Module, params: tuple[Param, ...]) -> tuple[tuple[Param, ...], ...]:
    """The FSDP units of ``block`` (whose parameters are ``params``) where ranks gather on the
    host, as kiln.distributed.parallel.apply_fsdp makes them (``host_units``), then the rest."""
    by_name = dict(zip((name for name, _ in block.named_parameters()), params, strict=True))
    names = {id(module): name for name, module in block.named_modules()}
    units = [
        tuple(by_name[f"{names[id(module)]}.{leaf}"] for leaf, _ in module.named_parameters())
        for module in host_units(block)
    ]
    taken = {p for unit in units for p in unit}
    rest = tuple(p for p in params if p not in taken)
    return (*units, rest) if rest else tuple(units)


@dataclass(frozen=True)
class Setup:
    """The settings a plan depends on, and that a recommendation may change."""

    micro_batch_size: int
    precision: str
    activation_checkpointing: bool
    strategy: str
    cpu_offload: bool
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0: one per stage, as parallel.pp_microbatches
    pp_virtual_stages: int = 1
    pp_layers: tuple[int, ...] = ()  # each stage's layers (parallel.pp_layers); empty: equal
    ep: int = 1  # data-parallel ranks that split a mixture of experts' experts
    dp_replicate: int = 1  # HSDP: replicas of the model, each sharded over dp / dp_replicate ranks
    cp: int = 1  # data-parallel ranks that split each sequence
    optimizer: str = "adamw"  # or "muon": one momentum buffer for the hidden matrices
    # Compiled from the first step: Inductor's graph keeps less than eager autograd. (Compiled
    # after eager steps, the eager ones set the peak.)
    compiled: bool = False
    compiled_steps: bool = False  # the steps that set the pace are compiled (train.compile)
    compile_auto: bool = False  # train.compile = "auto", which a pipeline turns off
    selective: bool = False  # train.activation_checkpointing = "selective"

    @property
    def checkpointing(self) -> bool | str:
        """train.activation_checkpointing's value."""
        return "selective" if self.selective else self.activation_checkpointing

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different batches: a context-parallel group reads one."""
        return self.dp // self.cp

    @property
    def stages(self) -> int:
        """Stages of the whole pipeline (pp x virtual stages per rank)."""
        return self.pp * self.pp_virtual_stages

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches each micro-batch is cut into; 1 without a pipeline."""
        return 1 if self.pp == 1 else self.pp_microbatches or self.stages

    @property
    def pipeline_micro(self) -> int:
        """Sequences a stage computes at once: a micro-batch, or a pipeline's slice of one."""
        return self.micro_batch_size // self.microbatches

    @property
    def autocast(self) -> bool:
        return self.precision != "fp32"

    @property
    def sharded(self) -> bool:
        """FSDP is applied: over several data-parallel ranks, or in one process to offload."""
        return self.strategy != "ddp" and (self.dp > 1 or self.cpu_offload)

    @property
    def offload(self) -> bool:
        return self.sharded and self.cpu_offload

    @property
    def splits(self) -> bool:
        """A rank holds part of the model: FSDP (or its offload), tensor or pipeline parallelism."""
        return self.sharded or self.tp > 1 or self.pp > 1

    @property
    def gathered_bytes(self) -> int:
        """Bytes per element of the parameters a block computes with: FSDP gathers them in bf16
        under bf16 and fp8 (MixedPrecisionPolicy); otherwise they are the fp32 master weights."""
        return 2 if self.sharded and self.precision in ("bf16", "fp8") else 4

    def overrides(self, base: Setup) -> list[str]:
        """The ``--set`` items that turn ``base`` into this setup."""
        keys = {
            "micro_batch_size": "train.micro_batch_size",
            "precision": "train.precision",
            "checkpointing": "train.activation_checkpointing",
            "strategy": "parallel.strategy",
            "cpu_offload": "parallel.cpu_offload",
            "tp": "parallel.tp",
            "pp": "parallel.pp",
            "ep": "parallel.ep",
            "cp": "parallel.cp",
            "dp_replicate": "parallel.dp_replicate",
        }
        if self.pp > 1:
            keys.update(
                pp_schedule="parallel.pp_schedule",
                microbatches="parallel.pp_microbatches",
                pp_virtual_stages="parallel.pp_virtual_stages",
                pp_layers="parallel.pp_layers",
            )
        out = []
        for attr, key in keys.items():
            value = getattr(self, attr)
            if value != getattr(base, attr):
                shown = str(value).lower() if isinstance(value, bool) else value
                out.append(f"{key}={','.join(map(str, value)) if isinstance(value, tuple) else shown}")
        return out


@dataclass(frozen=True)
class Target:
    """The device a plan is for."""

    kind: str  # cuda | cpu
    name: str
    memory: int
    memory_source: str
    peak_flops: float | None


@dataclass(frozen=True)
class Cluster:
    """How the devices are connected and how fast they compute: named assumptions, each with
    where its value came from (a default, or the option that set it)."""

    gpus_per_node: int = GPUS_PER_NODE
    nvlink: float = LINK_EFFICIENCY * NVLINK_BYTES_PER_S["H100"]  # bytes/s per GPU, inside a node
    network: float = LINK_EFFICIENCY * NETWORK_BYTES_PER_S  # bytes/s per GPU, between nodes
    pcie: float = PCIE_BYTES_PER_S  # bytes/s per GPU, to and from the host
    efficiency: float = COMPUTE_EFFICIENCY
    sources: tuple[tuple[str, str], ...] = ()

    def nodes(self, world_size: int) -> int:
        return -(-world_size // self.gpus_per_node)

    def link(self, span: int) -> tuple[str, float]:
        """The link a group of ``span`` consecutive ranks communicates over: NVLink while it
        stays inside a node, else the network, whose per-GPU rate then bounds the ring."""
        return ("nvlink", self.nvlink) if span <= self.gpus_per_node else ("network", self.network)

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "")


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds: its blocks (as many as the fullest rank), its part of the
    root, whether it runs the embedding and the output layer, and how many pipeline
    micro-batches' activations it holds at once, in units of all its blocks."""

    name: str
    blocks: int
    root: tuple[Param, ...]
    embedding: bool
    head: bool
    in_flight: float = 1.0


def pipeline_stages(shape: ModelShape, s: Setup) -> list[Stage]:
    """The whole model without a pipeline; else its first and last stage (a middle stage holds
    the first's blocks, fewer micro-batches and no embedding: never more).

    Layers split evenly, or as ``parallel.pp_layers`` gives them: then a middle rank that holds
    more layers than the first is a third stage to estimate. In flight on the
    first rank: every micro-batch under gpipe; p under 1f1b; under
    interleaved 1F1B with v stages per rank, (v + 1) p - 1 virtual-stage chunks, p + (p - 1) / v
    ranks' worth (Megatron-LM's warm-up; Korthikanti et al. 2022). On the last: one under 1f1b,
    ((v - 1) p + 1) / v interleaved."""
    if s.pp == 1:
        return [Stage("", shape.n_layer, shape.root, True, True)]
    p, v, m = s.pp, s.pp_virtual_stages, s.microbatches
    # Each rank's layers: those of its stages r, r + p, ...
    held = [sum(s.pp_layers[r::p]) for r in range(p)] if s.pp_layers else [shape.n_layer // p] * p
    if s.pp_schedule == "gpipe":
        first = last = float(m)
    elif s.pp_schedule == "interleaved_1f1b":
        first, last = p + (p - 1) / v, ((v - 1) * p + 1) / v
    else:
        first, last = float(min(m, p)), 1.0
    stages = [
        Stage("first stage", held[0], shape.before, True, False, first),
        Stage("last stage", held[-1], shape.after, False, True, last),
    ]
    if max(held[1:-1], default=0) > held[0]:
        r = max(range(1, p - 1), key=lambda r: held[r])
        # In flight on rank r: p - r under 1f1b (the warm-up shortens down the pipeline).
        flight = float(min(m, p - r)) if s.pp_schedule == "1f1b" else first
        stages.append(Stage("heaviest middle stage", held[r], (), False, False, flight))
    return stages


# ---------------------------------------------------------------------------------------------
# Memory


def _split_dims(param: Param, s: Setup) -> list[int]:
    """A parameter's shape on one rank before FSDP: split by tensor parallelism, an expert
    weight's experts by expert parallelism (which the config has them divisible by)."""
    dims = list(param.shape)
    if s.tp > 1 and param.tp_dim is not None:
        dims[param.tp_dim] //= s.tp
    if param.expert:
        dims[0] //= s.ep
    return dims


def _shards(param: Param, s: Setup) -> int:
    """The ranks FSDP shards a parameter over: the data-parallel ranks of one replica (all of
    them but under HSDP), and an expert-parallel rank's experts over those of them that hold the
    same experts."""
    ranks = s.dp // s.dp_replicate
    return max(1, ranks // s.ep) if param.expert else ranks


def _local_numel(param: Param, s: Setup) -> int:
    """Elements of one parameter on one device: split by tensor and expert parallelism, then
    sharded along dim 0 by FSDP, which pads every shard to the largest (ceil)."""
    dims = _split_dims(param, s)
    if s.sharded:
        dims[0] = -(-dims[0] // _shards(param, s))
    return math.prod(dims)


def _fsdp_gathered(params: tuple[Param, ...], s: Setup) -> tuple[Param, ...]:
    """What FSDP all-gathers of ``params`` to compute with: all of them where it shards, but the
    experts of an expert-parallel rank no other rank holds, which it leaves alone
    (kiln.distributed.parallel.apply_fsdp)."""
    if not s.sharded:
        return ()
    return tuple(p for p in params if not (p.expert and s.ep > 1 and _shards(p, s) == 1))


def _gathered_numel(params: tuple[Param, ...], s: Setup) -> int:
    """Elements of a group of parameters once FSDP has all-gathered it (tensor- and
    expert-parallel splits kept)."""
    return sum(math.prod(_split_dims(p, s)) for p in params)


def _trained(params: tuple[Param, ...]) -> tuple[Param, ...]:
    return tuple(p for p in params if p.kind == "trained")


def _stored_bytes(param: Param, s: Setup) -> float:
    """Bytes per element of a parameter as a rank keeps it. What trains is fp32 in every
    precision: autocast keeps fp32 master weights, and FSDP shards the fp32 originals. A LoRA
    run's frozen base is stored in the compute dtype (kiln.train.precision.store_frozen), the
    weights a QLoRA base adapts in NF4."""
    if param.kind == "nf4":
        return NF4_BYTES
    return DTYPES[s.precision].itemsize if param.kind == "frozen" else 4


def _gathered_bytes(params: tuple[Param, ...], s: Setup) -> int:
    """Bytes of a group of parameters once FSDP has all-gathered it: what trains in the dtype
    the setup gathers it in, a frozen base as it is stored."""
    return int(
        sum(
            (s.gathered_bytes if p.kind == "trained" else _stored_bytes(p, s)) * math.prod(_split_dims(p, s))
            for p in params
        )
    )


def model_state(shape: ModelShape, s: Setup, stage: Stage | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on each device of ``stage`` (the whole
    model by default; on the host with CPU offload): the fp32 parameters that train, their fp32
    gradients, AdamW's exp_avg and exp_avg_sq like each of them and one fp32 step count per
    parameter tensor (with train.optimizer=muon, one momentum buffer for each hidden matrix
    instead); and a LoRA run's frozen base (``frozen_parameters``), which has neither."""
    if stage is None:  # the whole model: each kind of block as many times as it is there
        small = shape.small_blocks
        counted = [(p, 1) for p in shape.root] + [(p, shape.n_layer - small) for p in shape.block]
        counted += [(p, small) for p in shape.small_block]
    else:  # a stage's blocks, as its largest
        counted = [(p, 1) for p in stage.root] + [(p, stage.blocks) for p in shape.block]
    numel = sum(n * _local_numel(p, s) for p, n in counted if p.kind == "trained")
    tensors = sum(n for p, n in counted if p.kind == "trained")
    frozen = sum(n * int(_stored_bytes(p, s) * _local_numel(p, s)) for p, n in counted if p.kind != "trained")
    # Muon keeps one fp32 momentum buffer for each hidden matrix (2-D, no vocabulary-sized side:
    # kiln.train.optim.muon_groups) and no step count; AdamW's two moments for the rest.
    vocab = getattr(shape.args, "vocab_size", None)
    muon = [(p, n) for p, n in counted if s.optimizer == "muon" and p.kind == "trained" and _hidden(p, vocab)]
    hidden, hidden_tensors = sum(n * _local_numel(p, s) for p, n in muon), sum(n for _, n in muon)
    return {
        "parameters": 4 * numel,
        "frozen_parameters": frozen,
        "gradients": 4 * numel,
        "optimizer_state": 8 * (numel - hidden) + 4 * hidden + 4 * (tensors - hidden_tensors),
    }


def _hidden(p: Param, vocab: int | None) -> bool:
    """A matrix Muon updates (see ``model_state``): 2-D, neither side the vocabulary."""
    return len(p.shape) == 2 and vocab not in p.shape


def _casts_weights(s: Setup) -> bool:
    """Autocast copies fp32 weights to bf16/fp16 and caches the copies until it exits; the
    matmuls' autograd nodes keep them until their backward. bf16 weights gathered by FSDP need
    no copy."""
    return s.autocast and s.gathered_bytes == 4


def _cast_copies(params: tuple[Param, ...], s: Setup) -> int:
    """Bytes of the 16-bit copies autocast computes with of the fp32 weights in ``params`` that
    train: all of them unless FSDP gathers them in bf16 (_casts_weights); an expert-parallel
    rank's experts that FSDP leaves alone are cast even then."""
    if not s.autocast:
        return 0
    in_bf16 = () if _casts_weights(s) else _fsdp_gathered(params, s)
    return 2 * _gathered_numel(tuple(p for p in _trained(params) if p not in in_bf16), s)


@functools.cache
def fused_adamw(device: str) -> bool:
    """Whether kiln's optimizer builder picks the fused AdamW kernel for this kind of device."""
    probe = torch.nn.Linear(1, 1, bias=False)
    return bool(build_optimizer(probe, TrainConfig(), torch.device(device)).defaults.get("fused"))


def _optimizer_workspace(shape: ModelShape, s: Setup, device: str, stage: Stage) -> int:
    """AdamW's temporaries on the device. The fused kernel has none (nor has the device when the
    step runs on the host); the foreach kernels make sqrt(exp_avg_sq) for every parameter at
    once, the per-parameter loop it and its quotient for one parameter at a time."""
    if s.offload or fused_adamw(device):
        return 0
    if device == "cuda":
        return model_state(shape, s, stage)["parameters"]
    return 2 * 4 * max((_local_numel(p, s) for p in _trained(stage.root + shape.block)), default=0)


def memory_phases(
    shape: ModelShape, s: Setup, seq_len: int, rank_batch: int, device: str, stage: Stage | None = None
) -> dict[str, dict[str, int]]:
    """Bytes on one device of ``stage`` (the whole model by default) at the high points of a
    training step, component by component.

    ``rank_batch`` is the sequences of one optimizer step on this data-parallel rank (the loop
    holds all of them and splits them into micro-batches; under context parallelism each rank
    computes 1 / cp of each). Memory during the backward pass is linear in the block being
    differentiated, so its first and last blocks bound it.
    """
    stage = stage or pipeline_stages(shape, s)[0]
    blocks, mem = stage.blocks, shape.memory
    ctx = MemoryContext(
        tokens=s.pipeline_micro * seq_len // s.cp,
        autocast=s.autocast,
        residual_bytes=s.gathered_bytes if s.sharded else 4,
        tp=s.tp,
        casts_weights=_casts_weights(s),
        seq_len=seq_len,
        cp=s.cp,
        device=device,
        compiled=s.compiled,
        sequence_parallel=s.tp > 1 and shape.plan.sequence_parallel,
    )
    state = model_state(shape, s, stage)
    on_device = {k: 0 if s.offload else v for k, v in state.items()}
    static = {
        "parameters": on_device["parameters"],
        "frozen_parameters": on_device["frozen_parameters"],
        "optimizer_state": on_device["optimizer_state"],
        "model_buffers": shape.buffer_bytes,
        "batch": rank_batch * seq_len * 2 * 8,
    }  # int64 inputs, targets
    if s.strategy == "ddp" and s.dp > 1:
        static["ddp_gradient_buckets"] = state["gradients"]  # DDP reduces from its own copy of the gradients

    all_grads = on_device["gradients"]
    # In a pipeline FSDP reduces once, after the last pipeline micro-batch (torch's
    # PipelineStage turns gradient sync off before): until then each rank adds up unsharded
    # fp32 gradients of its stage.
    accumulated = all_grads
    if s.sharded and s.pp > 1:
        trained = _gathered_numel(_trained(stage.root), s) + blocks * _gathered_numel(_trained(shape.block), s)
        accumulated = 4 * trained
    # Micro-batches after the first of a step (every pipeline micro-batch after the first)
    # start with the gradients of those before.
    held = accumulated if rank_batch > s.micro_batch_size or s.pp > 1 else 0
    block_grads = 0 if s.offload else 4 * sum(_local_numel(p, s) for p in _trained(shape.block))
    peak_grad = next((p for p in _trained(shape.block) if p.name == mem.backward_peak_grad), None)
    new_grad = 0 if s.offload or peak_grad is None else 4 * _local_numel(peak_grad, s)
    root_grads = all_grads - blocks * block_grads

    acts = mem.block_activations(ctx)
    before = mem.before_blocks(ctx) if stage.embedding else 0
    # Activation checkpointing keeps each block's input and recomputes the rest in backward.
    kept = mem.checkpointed_block(ctx) if s.activation_checkpointing else acts
    head = mem.head(ctx)
    after = mem.after_blocks(ctx) if stage.head else 0
    # Other pipeline micro-batches whose forward this rank has run and whose backward it has not.
    one_in_flight = before + blocks * kept + (after + head.saved if stage.head else 0)
    if stage.in_flight > 1:
        static["pipeline_activations"] = int((stage.in_flight - 1) * one_in_flight)

    # The matrices' copies stay in autocast's cache through the forward; a mixture of experts'
    # grouped matrix multiply casts its experts itself (kiln.models.gpt.moe.grouped_mm), so
    # checkpointing drops what it keeps for backward, and recomputes it there.
    block_copies = _cast_copies(tuple(p for p in shape.block if len(p.shape) == 2), s)
    saved_copies = block_copies + _cast_copies(tuple(p for p in shape.block if p.expert), s)
    forward_copies = blocks * (block_copies if s.activation_checkpointing else saved_copies)
    head_copy = mem.head_weight_copy(ctx) if stage.head else 0
    root_gathered = _gathered_bytes(stage.root, s)
    block_gathered = _gathered_bytes(_fsdp_gathered(shape.block, s), s)
    host_units = (
        sorted((_gathered_bytes(_fsdp_gathered(u, s), s) for u in shape.host_units), reverse=True)
        if device == "cpu"
        else []
    )

    def gathered(n_blocks: int) -> int:
        """FSDP keeps the root gathered all step; fsdp reshards a block after its forward and
        prefetches the next (two in flight), fsdp_grad_op keeps blocks until their backward.
        In a pipeline, backward does not reshard (PipelineStage), so a stage's blocks stay
        gathered from their first backward on.

        Where ranks gather on the host (gloo), the units are a block's large linear layers, and
        the one being gathered is there three times: gloo's flat receive buffer, FSDP's
        all-gather output and the unsharded parameters (kiln.distributed.parallel.apply_fsdp)."""
        if not s.sharded:
            return 0
        if host_units and n_blocks:
            in_flight = sum(host_units[:2]) if s.strategy == "fsdp" and s.pp == 1 else n_blocks * block_gathered
            return root_gathered + in_flight + 2 * host_units[0]
        in_flight = min(n_blocks, 2 if s.strategy == "fsdp" and s.pp == 1 else blocks)
        return root_gathered + in_flight * block_gathered

    def block_backward(i: int) -> dict[str, int]:
        """At the peak of block i's backward (the family's memory model says what it holds)."""
        grads = (held or root_grads + (blocks - 1 - i) * block_grads) + new_grad
        if s.activation_checkpointing:
            activations, copies = before + (i + 1) * kept + acts, saved_copies
        else:
            activations, copies = before + (i + 1) * acts, (i + 1) * saved_copies
        # FSDP reduce-scatters a block's gradient from an unsharded fp32 copy.
        reducing = 4 * _gathered_numel(_trained(_fsdp_gathered(shape.block, s)), s)
        return {
            **static,
            "gradients": grads,
            "gathered_parameters": gathered(i + 1) + reducing,
            "autocast_weight_copies": copies,
            "activations": activations,
            "backward_workspace": mem.block_backward_workspace(ctx),
        }

    forward_end = {
        **static,
        "gradients": held,
        "gathered_parameters": gathered(blocks),
        "activations": before + blocks * kept + after,
    }
    phases = {}
    if stage.head:
        phases["forward: output layer and loss"] = {
            **forward_end,
            "autocast_weight_copies": forward_copies + head_copy,
            "output_layer_and_loss": head.saved + head.transient,
        }
        # Leaving autocast dropped the weight copies nothing saved (the output layer's; all of
        # them with checkpointing).
        phases["backward: output layer"] = {
            **forward_end,
            "output_layer_and_loss": head.backward,
            "autocast_weight_copies": (0 if s.activation_checkpointing else blocks * saved_copies),
        }
    else:
        phases["forward: end of the stage"] = {**forward_end, "autocast_weight_copies": forward_copies}
    phases["backward: last block"] = block_backward(blocks - 1)
    phases["backward: first block"] = block_backward(0)
    # Reducing the accumulated gradients makes their shards beside them.
    reduced = accumulated + (all_grads if accumulated != all_grads else 0)
    end = {**static, "gradients": reduced, "gathered_parameters": gathered(0)}
    end.pop("pipeline_activations", None)
    if stage.embedding:
        # A frozen embedding (LoRA's) gets no gradient.
        trains_embedding = any(p.kind == "trained" for p in shape.before)
        phases["backward: embedding"] = {
            **end,
            "backward_workspace": mem.embedding_backward(ctx, accumulating=bool(held)) if trains_embedding else 0,
        }
    else:
        phases["backward: end of the stage"] = end
    phases["optimizer step"] = {
        **{k: v for k, v in end.items() if k != "gathered_parameters"},
        "gradients": all_grads,
        "optimizer_workspace": _optimizer_workspace(shape, s, device, stage),
    }
    prefix = f"{stage.name}, " if stage.name else ""
    return {prefix + name: {k: v for k, v in parts.items() if v} for name, parts in phases.items()}


def process_bytes(shape: ModelShape, target: Target) -> int:
    """A rank's process in host memory before its first tensor (see the module constants)."""
    return PROCESS_BYTES + HF_LIBRARIES_BYTES * shape.imports_hf + CUDA_HOST_BYTES * (target.kind == "cuda")


def overhead_bytes(shape: ModelShape, target: Target, s: Setup, allocated: int) -> int:
    """What a process needs on its device beyond its tensors (rules of thumb, see the module
    constants): on the CPU, the process itself."""
    if target.kind != "cuda":
        return process_bytes(shape, target)
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if s.world_size > 1 else 0) + int(ALLOCATOR_SLACK * allocated)


def whole_model_setup(shape: ModelShape, s: Setup, device: str) -> dict[str, int]:
    """A device's tensors while a rank that creates the whole model (``ModelShape.created_whole``)
    holds it, before it is split: on the CPU in fp32 as created; on a GPU as the run moves it
    there, in the precision and format it trains in (kiln.train.setup.start_model)."""
    if device != "cuda":
        return {"parameters": 4 * shape.num_params(), "model_buffers": shape.buffer_bytes}
    whole = model_state(shape, dataclasses.replace(s, world_size=1, tp=1, pp=1, ep=1, cp=1, cpu_offload=False))
    return {
        "parameters": whole["parameters"],
        "frozen_parameters": whole["frozen_parameters"],
        "model_buffers": shape.buffer_bytes,
    }


def setup_host_bytes(shape: ModelShape, s: Setup, target: Target, stages: list[Stage], step: int) -> int:
    """A rank's peak host memory from its start through its first step: the process, and the
    larger of what initialising the model and what the step (``step`` bytes) hold on the host.

    Initialising: where every rank creates the whole model, all of it in fp32 as created.
    Otherwise each rank allocates only its own parameters (on the host on a CPU run or with
    CPU offload) and makes one whole tensor at a time, in fp32 as created or as read from a
    file, to copy its slice from (kiln.distributed.parallel.materialize): the largest is the
    bound."""
    if shape.created_whole:
        init = 4 * shape.num_params()
    else:
        largest = 4 * max(math.prod(p.shape) for p in shape.root + shape.block)
        held = 0
        if target.kind != "cuda" or s.offload:
            held = max(sum(model_state(shape, s, st)[k] for k in ("parameters", "frozen_parameters")) for st in stages)
        init = held + largest
    return process_bytes(shape, target) + max(init, step)


@dataclass
class MemoryEstimate:
    phases: dict[str, dict[str, int]]
    peak_phase: str
    allocated: int  # tensor bytes at the peak
    overhead: int
    host: int  # bytes each rank keeps in host memory (CPU offload)
    host_setup: int  # a rank's peak host memory through setup and its first step

    @property
    def total(self) -> int:
        return self.allocated + self.overhead

    @property
    def components(self) -> dict[str, int]:
        return self.phases[self.peak_phase]


# ---------------------------------------------------------------------------------------------
# Time


def _micro_batch_time(tokens: int) -> float:
    return 1.0 + SMALL_MICRO_TIME * max(0.0, math.log2(FULL_MICRO_TOKENS / tokens))


def _width_time(width: int) -> float:
    """How much longer matmuls of ``width`` columns take than wide ones."""
    return 1.0 + SMALL_MICRO_TIME * max(0.0, math.log2(FULL_WIDTH / width))


def offload_seconds(shape: ModelShape, s: Setup, micro_batches: int, pcie: float = PCIE_BYTES_PER_S) -> float:
    """CPU offload, per step: every all-gather first copies the rank's fp32 shards up (twice
    per micro-batch under fsdp, once under fsdp_grad_op), every reduce-scatter copies gradient
    shards down, and AdamW reads 4 and writes 3 arrays like the shards in host memory."""
    if not s.offload:
        return 0.0
    state = model_state(shape, s)
    shards = state["parameters"] + state["frozen_parameters"]
    gathers = 2 if s.strategy == "fsdp" else 1
    copies = micro_batches * (gathers * shards + state["gradients"]) / pcie
    return copies + 7 * state["parameters"] / CPU_ADAM_BYTES_PER_S


def ring(n: int) -> float:
    """The share of a buffer each rank sends in a ring all-gather or reduce-scatter of n ranks
    (an all-reduce is both: twice this), and in an all-to-all of n ranks (the rest of its own)."""
    return (n - 1) / n


def _fsdp_sent(params: tuple[Param, ...], s: Setup) -> tuple[float, float, float]:
    """Bytes a rank sends to all-gather ``params`` in the dtype it computes with, and to
    reduce-scatter the fp32 gradients of those that train: each over the ranks FSDP shards it
    over (none for an expert-parallel rank's own experts where no other rank holds them); and
    under HSDP, to all-reduce its gradients' shard over the replicas."""
    gather = sum(ring(_shards(p, s)) * _gathered_bytes((p,), s) for p in params)
    scatter = sum(ring(_shards(p, s)) * 4 * math.prod(_split_dims(p, s)) for p in _trained(params))
    shard_bytes = sum(4 * math.prod(_split_dims(p, s)) / _shards(p, s) for p in _trained(params))
    return gather, scatter, 2 * ring(s.dp_replicate) * shard_bytes


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on its slowest rank, by what the rank is doing or waiting
    for, and the reference the scaling efficiency compares with."""

    compute: float  # kernels, recomputation included, at the assumed efficiency
    tensor_parallel: float  # all-reduces inside each block: on the critical path
    expert_parallel: float  # all-to-alls of each mixture of experts' tokens: on the critical path
    context_parallel: float  # each block's all-gathers of keys and values: on the critical path
    data_parallel: float  # the part of FSDP's or DDP's collectives the compute does not hide
    data_parallel_traffic: float  # all of their time, hidden or not
    pipeline_sends: float  # activations and their gradients between stages
    bubble: float  # pipeline ranks idle while it fills and drains
    offload: float  # host copies and the CPU optimizer step (CPU offload)
    reference: float  # the step's work spread evenly, each GPU at the one-GPU rate, nothing else
    links: dict[str, str] = field(default_factory=dict)  # which link each group uses

    @property
    def total(self) -> float:
        communication = self.tensor_parallel + self.expert_parallel + self.context_parallel + self.pipeline_sends
        return self.compute + communication + self.data_parallel + self.bubble + self.offload

    @property
    def scaling_efficiency(self) -> float:
        return self.reference / self.total


# ---------------------------------------------------------------------------------------------
# One workload, many setups


@dataclass(frozen=True)
class Workload:
    """What stays fixed while a plan compares setups: the model, the batch, the device and the
    cluster."""

    shape: ModelShape
    seq_len: int
    global_batch: int
    target: Target
    cluster: Cluster = Cluster()
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def rank_batch(self, s: Setup) -> int:
        return self.global_batch // s.data_ranks

    def micro_batch_options(self, s: Setup) -> list[int]:
        """Micro-batch sizes that keep the global batch: divisors of each rank's share, and
        with a pipeline, multiples of its micro-batch count."""
        rows = self.rank_batch(s)
        return [m for m in range(1, rows + 1) if rows % m == 0 and m % s.microbatches == 0]

    def stages(self, s: Setup) -> list[Stage]:
        return pipeline_stages(self.shape, s)

    def memory(self, s: Setup) -> MemoryEstimate:
        key = ("memory", s)
        if key not in self._cache:
            shape, device, stages = self.shape, self.target.kind, self.stages(s)
            phases = {}
            if shape.created_whole and s.splits:
                phases["setup: the whole model, before it is split"] = whole_model_setup(shape, s, device)
            for stage in stages:
                phases.update(memory_phases(shape, s, self.seq_len, self.rank_batch(s), device, stage))
            peak_phase = max(phases, key=lambda name: sum(phases[name].values()))
            allocated = sum(phases[peak_phase].values())
            host = max(sum(model_state(shape, s, st).values()) for st in stages) if s.offload else 0
            # On the CPU the device is the host; a GPU's step keeps on the host what it offloads.
            step = allocated if device != "cuda" else host
            self._cache[key] = MemoryEstimate(
                phases,
                peak_phase,
                allocated,
                overhead_bytes(shape, self.target, s, allocated),
                host,
                setup_host_bytes(shape, s, self.target, stages, step),
            )
        return self._cache[key]

    def fits(self, s: Setup) -> bool:
        return self.memory(s).total <= self.target.memory

    @property
    def flops_per_token(self) -> float:
        if "flops" not in self._cache:
            self._cache["flops"] = self.shape.flops_per_token(self.seq_len)
        return self._cache["flops"]

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.global_batch * self.seq_len

    def seconds_at_peak(self, world_size: int) -> float | None:
        """The MFU bound: every device at 100% of its peak, nothing else."""
        peak = self.target.peak_flops
        return self.flops_per_step / (peak * world_size) if peak else None

    def mfu(self, s: Setup) -> float | None:
        """Model FLOPs utilisation: the model's FLOPs (the family's count, recomputation not
        included) over what the devices could do at their peak in the estimated step time."""
        bound = self.seconds_at_peak(s.world_size)
        return bound / self.time(s).total if bound else None

    def seconds(self, s: Setup) -> float:
        return self.time(s).total

    def time(self, s: Setup) -> StepTime:
        """Estimated time per step. Where the device's peak is unknown, a nominal one still
        orders setups."""
        key = ("time", s)
        if key not in self._cache:
            self._cache[key] = self._time(s)
        return self._cache[key]

    def _time(self, s: Setup) -> StepTime:
        c, d = self.cluster, self.shape.memory.d_model
        rate = (self.target.peak_flops or NOMINAL_PEAK_FLOPS) * c.efficiency
        if s.precision == "fp32" and self.target.kind == "cuda":
            rate /= FP32_TIME
        if self.target.kind == "cuda":
            rate *= (COMPILED_SPEEDUP if s.compiled_steps else 1.0) * (FP8_SPEEDUP if s.precision == "fp8" else 1.0)
        recompute = RECOMPUTE_TIME if s.activation_checkpointing else SELECTIVE_TIME if s.selective else 1.0
        head_flops = self.shape.head_flops_per_token
        block_flops = (self.flops_per_token - head_flops) / self.shape.n_layer

        head_share = head_flops / (s.tp if self.shape.head_split else 1)

        def stage_flops(stage: Stage) -> float:  # per token, on one rank of the stage
            return stage.blocks * block_flops * recompute / s.tp + (head_share if stage.head else 0.0)

        busiest = max(self.stages(s), key=stage_flops)
        rounds = self.rank_batch(s) // s.micro_batch_size  # micro-batches (pipeline schedules) per step
        m, p, v = s.microbatches, s.pp, s.pp_virtual_stages
        # What a stage computes at once: under context parallelism 1 / cp of each sequence, whose
        # attention over all of it the family's FLOPs per token count.
        tokens = s.pipeline_micro * self.seq_len // s.cp
        act_bytes = 2 if s.autocast else 4
        residual = s.gathered_bytes if s.sharded else 4
        forwards = 2 if s.activation_checkpointing else 1  # of each block: recomputation repeats it
        links = {}

        # One slot: a pipeline micro-batch's forward and backward on the busiest rank.
        narrow = _width_time(d // s.tp) if s.tp > 1 else 1.0
        slot_compute = tokens * stage_flops(busiest) / rate * _micro_batch_time(tokens) * narrow
        slot_tp = slot_ep = slot_cp = slot_sends = 0.0
        if s.tp > 1:
            # Column-wise then row-wise projections: an all-reduce of the [tokens, d_model]
            # activations after attention and after the MLP forward, two of their gradients
            # backward, two more when checkpointing recomputes the forward.
            # Forward ones carry the matmuls' 16-bit outputs, backward ones the gradients of the
            # blocks' inputs, in the residual stream's dtype.
            links["tensor_parallel"], bandwidth = c.link(s.tp)
            per_block = 2 * forwards * act_bytes + 2 * residual
            slot_tp = busiest.blocks * per_block * 2 * ring(s.tp) * tokens * d / bandwidth
        if s.ep > 1:
            # Each mixture of experts sends every token's k copies to its experts' ranks (the
            # layer's input, in the residual stream's dtype) and takes the experts' outputs back:
            # two all-to-alls per forward, two of their gradients backward. The ep ranks are
            # adjacent data-parallel ranks.
            links["expert_parallel"], bandwidth = c.link(s.tp * s.ep)
            layers = min(busiest.blocks, self.shape.n_layer - self.shape.small_blocks)
            routed = ring(s.ep) * tokens * self.shape.experts_per_token * d
            slot_ep = layers * (forwards + 1) * (residual + act_bytes) * routed / bandwidth
        if s.cp > 1:
            # Each block's attention all-gathers the keys and values of the whole sequences from
            # the group in every forward and reduce-scatters their gradients backward.
            links["context_parallel"], bandwidth = c.link(s.tp * s.cp)
            keys = 2 * tokens * s.cp * self.shape.kv_width // s.tp * act_bytes
            slot_cp = busiest.blocks * (forwards + 1) * ring(s.cp) * keys / bandwidth
        if p > 1:
            # Each virtual stage sends its output forward and receives its gradient back.
            links["pipeline"], bandwidth = c.link(s.world_size)
            slot_sends = 2 * v * tokens * d * residual / bandwidth
        slot = slot_compute + slot_tp + slot_ep + slot_cp + slot_sends
        round_compute = m * slot_compute

        traffic = exposed = 0.0
        if s.dp > 1:
            # The ranks of one replica are adjacent (HSDP's replicas span the nodes).
            links["data_parallel"], bandwidth = c.link(s.tp * (s.dp // s.dp_replicate))
            root_params, root_grads, root_replicas = _fsdp_sent(busiest.root, s)
            block_params, block_grads, block_replicas = _fsdp_sent(self.shape.block, s)
            params = root_params + busiest.blocks * block_params
            grads = root_grads + busiest.blocks * block_grads
            # HSDP: each reduce-scatter's shard all-reduced over the replicas, on their own link.
            replicas = last_replicas = 0.0
            if s.dp_replicate > 1:
                links["data_parallel_replicas"], across = c.link(s.tp * s.dp)
                replicas = (root_replicas + busiest.blocks * block_replicas) / across
                last_replicas = (root_replicas + block_replicas) / across
            if s.sharded:
                # Per micro-batch: all-gathers of the parameters in their compute dtype (forward,
                # and backward again under fsdp), one reduce-scatter of fp32 gradients. In a
                # pipeline backward keeps the parameters gathered and the reduce-scatter waits
                # for the last pipeline micro-batch: fsdp gathers again only for each backward
                # after a forward resharded, fsdp_grad_op once. They overlap the compute, but
                # not the root's and the first block's all-gather before it nor the last
                # reduce-scatters after it.
                gathers = (m if p > 1 else 2) if s.strategy == "fsdp" else 1
                per_round = (gathers * params + grads) / bandwidth + replicas
                unhidden = (root_params + root_grads + block_params + block_grads) / bandwidth + last_replicas
                traffic = rounds * per_round
                exposed = rounds * (max(0.0, per_round - round_compute) + unhidden)
            else:
                # DDP all-reduces fp32 gradients once, in buckets during the last micro-batch's
                # backward (2/3 of its compute); a pipeline all at once, after its last schedule.
                traffic = 2 * grads / bandwidth
                exposed = traffic if p > 1 else max(0.0, traffic - 2 / 3 * round_compute)

        # The same work (recomputation included) on one GPU's micro-batch, spread evenly.
        work = self.global_batch * self.seq_len * ((self.flops_per_token - head_flops) * recompute + head_flops)
        reference = work / (s.world_size * rate) * _micro_batch_time(s.micro_batch_size * self.seq_len)
        return StepTime(
            compute=rounds * m * slot_compute,
            tensor_parallel=rounds * m * slot_tp,
            expert_parallel=rounds * m * slot_ep,
            context_parallel=rounds * m * slot_cp,
            data_parallel=exposed,
            data_parallel_traffic=traffic,
            pipeline_sends=rounds * m * slot_sends,
            bubble=rounds * (p - 1) / v * slot,
            offload=offload_seconds(self.shape, s, rounds, c.pcie),
            reference=reference,
            links=links,
        )
