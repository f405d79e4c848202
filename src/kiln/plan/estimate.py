"""The memory each device needs for a training step, and the step's time, before anything is
allocated.

The model is built on the ``meta`` device (shapes, no storage), so the parameter, gradient and
optimizer-state bytes are counted from the real parameter list, split and sharded as the
family's parallel plan and the setup say. What the model keeps for its backward pass comes from
its family's memory model (``kiln.models.MemoryModel``): kiln's GPT counts it tensor by tensor,
checked against live-tensor measurements of real training steps (tests/plan/test_plan.py). A
step's memory is followed through its phases (end of forward, backward of the output layer, of
the last and the first block, of the embedding, the optimizer step) on the first and the last
pipeline stage, and the plan reports the largest.

A step's time is the busiest rank's compute at an assumed fraction of the device's peak, plus
what compute does not hide: tensor-parallel all-reduces, the part of FSDP's or DDP's
collectives beyond the compute they overlap, pipeline sends, and the pipeline's bubble. Each
collective is costed as a ring over the link its group spans: NVLink inside a node, the network
between nodes. Everything below that says "rule of thumb" or "assumed" is an assumption, not a
measurement; docs/plan.md lists them and compares the estimates with published step times.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kiln.config import ConfigError, TrainConfig
from kiln.device import PEAK_FLOPS
from kiln.models.family import MemoryContext, MemoryModel, ModelFamily, ParallelPlan
from kiln.observe.memory import GIB
from kiln.train.optim import build_optimizer

# Rules of thumb (docs/plan.md). What a GPU process holds beyond its tensors: the CUDA context,
# cuBLAS/cuDNN workspaces and kernel images, NCCL's buffers when there are peers, and the
# caching allocator's reserved-but-unallocated slack (fragmentation).
CUDA_CONTEXT_BYTES = GIB
NCCL_BYTES = GIB // 2
ALLOCATOR_SLACK = 0.10
# On the CPU: Python, libtorch and their heaps, before the first tensor.
CPU_PROCESS_BYTES = GIB // 2

# The fraction of the dense bf16 peak a training step's kernels reach while nothing waits for
# communication (--compute-efficiency), from torchtitan's published runs (docs/plan.md): its
# eager Llama 3.1 8B on 8 H100s (at 500 W) reaches 34% MFU with selective recomputation, about
# 0.37 of the peak in the kernels; on A100s Llama 3 8B and 70B reach 52-58% MFU.
COMPUTE_EFFICIENCY = 0.40
COMPUTE_EFFICIENCY_BY_GPU = {"A100": 0.60}
RECOMPUTE_TIME = 4 / 3  # activation checkpointing runs each block's forward twice: 3 -> 4 units
FULL_MICRO_TOKENS = 8192  # below this many tokens a micro-batch's matmuls lose efficiency:
SMALL_MICRO_TIME = 0.05  # this much more time per halving
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

    @classmethod
    def of(cls, family: ModelFamily, args: Any) -> ModelShape:
        """The shape of ``family``'s model for ``args``. Building a 70B-class model on the meta
        device takes about a second, so a process that plans one model again and again (tests,
        a script comparing clusters) builds it once."""
        key = (type(family).__module__, type(family).__qualname__, family.name, repr(args))
        if key not in _SHAPES:
            if len(_SHAPES) >= 8:
                _SHAPES.pop(next(iter(_SHAPES)))
            _SHAPES[key] = cls._build(family, args)
        return _SHAPES[key]

    @classmethod
    def _build(cls, family: ModelFamily, args: Any) -> ModelShape:
        with torch.device("meta"):
            model = family.build(args)
        plan = family.parallel_plan(args)
        blocks = plan.repeated_blocks(model)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        block = tuple(
            Param(name.removesuffix(".weight"), tuple(p.shape), plan.tp_split_dim(name))
            for name, p in (blocks[0].named_parameters() if blocks else ())
        )
        root = tuple(  # a tied matrix is listed once
            Param(name.removesuffix(".weight"), tuple(p.shape), None)
            for name, p in model.named_parameters()
            if id(p) not in in_blocks
        )
        # A pipeline's first and last stage hold the modules the plan names for them, a tied
        # matrix a copy on each side (kiln.distributed.pipeline). Without such names: the
        # registration order, which puts the embedding before the blocks and the final norm and
        # output layer after them (what the output layer's FLOPs need).
        before, after, seen_block = [], [], False
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in in_blocks:
                seen_block = True
                continue
            param = Param(name.removesuffix(".weight"), tuple(p.shape), None)
            module = name.split(".")[0]
            if plan.pipelined:
                before += [param] * (module in plan.pipeline_first)
                after += [param] * (module in plan.pipeline_last)
            else:
                (after if seen_block else before).append(param)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        pipeline_error = None if plan.pipelined else plan.pipeline_error(type(model).__name__)
        memory = family.memory_model(args)
        return cls(family, args, block, root, buffers, memory, plan, tuple(before), tuple(after), pipeline_error)

    @property
    def n_layer(self) -> int:
        return self.memory.n_layer

    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.root) + self.n_layer * sum(math.prod(p.shape) for p in self.block)

    def flops_per_token(self, seq_len: int) -> float:
        return self.family.flops_per_token(self.args, seq_len)

    @property
    def head_flops_per_token(self) -> float:
        """Training FLOPs per token of the matrices after the blocks (the output layer): 6 per
        weight, as in the family's count. They run on the pipeline's last stage, and whole on
        every tensor-parallel rank (kiln splits only the blocks)."""
        return 6.0 * sum(math.prod(p.shape) for p in self.after if len(p.shape) == 2)

    def pipelines(self, stages: int) -> bool:
        """Whether kiln can cut the model into ``stages`` pipeline stages: its plan names the
        stages' modules, and the layers split evenly (kiln.distributed.pipeline)."""
        return self.pipeline_error is None and self.n_layer % stages == 0

    def splits(self, tp: int) -> bool:
        """Whether the family's plan can split the blocks over ``tp`` ranks."""
        try:
            self.plan.check_tensor_parallel(tp, "")
        except ConfigError:
            return False
        return True


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

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

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
    def gathered_bytes(self) -> int:
        """Bytes per element of the parameters a block computes with: FSDP gathers them in bf16
        under bf16 and fp8 (MixedPrecisionPolicy); otherwise they are the fp32 master weights."""
        return 2 if self.sharded and self.precision in ("bf16", "fp8") else 4

    def overrides(self, base: Setup) -> list[str]:
        """The ``--set`` items that turn ``base`` into this setup."""
        keys = {
            "micro_batch_size": "train.micro_batch_size",
            "precision": "train.precision",
            "activation_checkpointing": "train.activation_checkpointing",
            "strategy": "parallel.strategy",
            "cpu_offload": "parallel.cpu_offload",
            "tp": "parallel.tp",
            "pp": "parallel.pp",
        }
        if self.pp > 1:
            keys.update(
                pp_schedule="parallel.pp_schedule",
                microbatches="parallel.pp_microbatches",
                pp_virtual_stages="parallel.pp_virtual_stages",
            )
        out = []
        for attr, key in keys.items():
            value = getattr(self, attr)
            if value != getattr(base, attr):
                out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
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

    Layers split evenly (kiln refuses a pipeline they do not fill equally). In flight on the
    first rank: every micro-batch under gpipe; p under 1f1b; under
    interleaved 1F1B with v stages per rank, (v + 1) p - 1 virtual-stage chunks, p + (p - 1) / v
    ranks' worth (Megatron-LM's warm-up; Korthikanti et al. 2022). On the last: one under 1f1b,
    ((v - 1) p + 1) / v interleaved."""
    if s.pp == 1:
        return [Stage("", shape.n_layer, shape.root, True, True)]
    p, v, m = s.pp, s.pp_virtual_stages, s.microbatches
    blocks = shape.n_layer // p
    if s.pp_schedule == "gpipe":
        first = last = float(m)
    elif s.pp_schedule == "interleaved_1f1b":
        first, last = p + (p - 1) / v, ((v - 1) * p + 1) / v
    else:
        first, last = float(min(m, p)), 1.0
    return [
        Stage("first stage", blocks, shape.before, True, False, first),
        Stage("last stage", blocks, shape.after, False, True, last),
    ]


# ---------------------------------------------------------------------------------------------
# Memory


def _split_dims(param: Param, s: Setup) -> list[int]:
    dims = list(param.shape)
    if s.tp > 1 and param.tp_dim is not None:
        dims[param.tp_dim] //= s.tp
    return dims


def _local_numel(param: Param, s: Setup) -> int:
    """Elements of one parameter on one device: split by tensor parallelism, then sharded along
    dim 0 by FSDP, which pads every shard to the largest (ceil)."""
    dims = _split_dims(param, s)
    if s.sharded:
        dims[0] = -(-dims[0] // s.dp)
    return math.prod(dims)


def _gathered_numel(params: tuple[Param, ...], s: Setup) -> int:
    """Elements of a group of parameters once FSDP has all-gathered it (tensor-parallel split kept)."""
    return sum(math.prod(_split_dims(p, s)) for p in params)


def model_state(shape: ModelShape, s: Setup, stage: Stage | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state on each device of ``stage`` (the whole
    model by default; on the host with CPU offload). All three are fp32 in every precision:
    autocast keeps fp32 master weights, and FSDP shards the fp32 originals. AdamW keeps
    exp_avg and exp_avg_sq like each parameter and one fp32 step count per parameter tensor."""
    root, blocks = (stage.root, stage.blocks) if stage else (shape.root, shape.n_layer)
    numel = sum(_local_numel(p, s) for p in root) + blocks * sum(_local_numel(p, s) for p in shape.block)
    tensors = len(root) + blocks * len(shape.block)
    return {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer_state": 8 * numel + 4 * tensors}


def _casts_weights(s: Setup) -> bool:
    """Autocast copies fp32 weights to bf16/fp16 and caches the copies until it exits; the
    matmuls' autograd nodes keep them until their backward. bf16 weights gathered by FSDP need
    no copy."""
    return s.autocast and s.gathered_bytes == 4


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
    return 2 * 4 * max(_local_numel(p, s) for p in stage.root + shape.block)


def memory_phases(
    shape: ModelShape, s: Setup, seq_len: int, rank_batch: int, device: str, stage: Stage | None = None
) -> dict[str, dict[str, int]]:
    """Bytes on one device of ``stage`` (the whole model by default) at the high points of a
    training step, component by component.

    ``rank_batch`` is the sequences of one optimizer step on this data-parallel rank (the loop
    holds all of them and splits them into micro-batches). Memory during the backward pass is
    linear in the block being differentiated, so its first and last blocks bound it.
    """
    stage = stage or pipeline_stages(shape, s)[0]
    blocks, mem = stage.blocks, shape.memory
    ctx = MemoryContext(
        tokens=s.pipeline_micro * seq_len,
        autocast=s.autocast,
        residual_bytes=s.gathered_bytes if s.sharded else 4,
        tp=s.tp,
        casts_weights=_casts_weights(s),
        seq_len=seq_len,
    )
    state = model_state(shape, s, stage)
    on_device = {k: 0 if s.offload else v for k, v in state.items()}
    static = {
        "parameters": on_device["parameters"],
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
        accumulated = 4 * (_gathered_numel(stage.root, s) + blocks * _gathered_numel(shape.block, s))
    # Micro-batches after the first of a step (every pipeline micro-batch after the first)
    # start with the gradients of those before.
    held = accumulated if rank_batch > s.micro_batch_size or s.pp > 1 else 0
    block_grads = 0 if s.offload else 4 * sum(_local_numel(p, s) for p in shape.block)
    peak_grad = next((p for p in shape.block if p.name == mem.backward_peak_grad), None)
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

    matrices = tuple(p for p in shape.block if len(p.shape) == 2)
    block_copies = 2 * _gathered_numel(matrices, s) if ctx.casts_weights else 0
    head_copy = mem.head_weight_copy(ctx) if stage.head else 0

    def gathered(n_blocks: int) -> int:
        """FSDP keeps the root gathered all step; fsdp reshards a block after its forward and
        prefetches the next (two in flight), fsdp_grad_op keeps blocks until their backward.
        In a pipeline, backward does not reshard (PipelineStage), so a stage's blocks stay
        gathered from their first backward on."""
        if not s.sharded:
            return 0
        in_flight = min(n_blocks, 2 if s.strategy == "fsdp" and s.pp == 1 else blocks)
        return s.gathered_bytes * (_gathered_numel(stage.root, s) + in_flight * _gathered_numel(shape.block, s))

    def block_backward(i: int) -> dict[str, int]:
        """At the peak of block i's backward (the family's memory model says what it holds)."""
        grads = (held or root_grads + (blocks - 1 - i) * block_grads) + new_grad
        if s.activation_checkpointing:
            activations, copies = before + (i + 1) * kept + acts, block_copies
        else:
            activations, copies = before + (i + 1) * acts, (i + 1) * block_copies
        # FSDP reduce-scatters a block's gradient from an unsharded fp32 copy.
        reducing = 4 * _gathered_numel(shape.block, s) if s.sharded else 0
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
            "autocast_weight_copies": blocks * block_copies + head_copy,
            "output_layer_and_loss": head.saved + head.transient,
        }
        # Leaving autocast dropped the weight copies nothing saved (the output layer's; all of
        # them with checkpointing).
        phases["backward: output layer"] = {
            **forward_end,
            "output_layer_and_loss": head.backward,
            "autocast_weight_copies": (0 if s.activation_checkpointing else blocks * block_copies),
        }
    else:
        phases["forward: end of the stage"] = {**forward_end, "autocast_weight_copies": blocks * block_copies}
    phases["backward: last block"] = block_backward(blocks - 1)
    phases["backward: first block"] = block_backward(0)
    # Reducing the accumulated gradients makes their shards beside them.
    reduced = accumulated + (all_grads if accumulated != all_grads else 0)
    end = {**static, "gradients": reduced, "gathered_parameters": gathered(0)}
    end.pop("pipeline_activations", None)
    if stage.embedding:
        phases["backward: embedding"] = {
            **end,
            "backward_workspace": mem.embedding_backward(ctx, accumulating=bool(held)),
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


def overhead_bytes(target: Target, s: Setup, allocated: int) -> int:
    """What a process needs beyond its tensors (rules of thumb, see the module constants)."""
    if target.kind != "cuda":
        return CPU_PROCESS_BYTES
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if s.world_size > 1 else 0) + int(ALLOCATOR_SLACK * allocated)


@dataclass
class MemoryEstimate:
    phases: dict[str, dict[str, int]]
    peak_phase: str
    allocated: int  # tensor bytes at the peak
    overhead: int
    host: int  # bytes each rank keeps in host memory (CPU offload)

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


def offload_seconds(shape: ModelShape, s: Setup, micro_batches: int, pcie: float = PCIE_BYTES_PER_S) -> float:
    """CPU offload, per step: every all-gather first copies the rank's fp32 shards up (twice
    per micro-batch under fsdp, once under fsdp_grad_op), every reduce-scatter copies gradient
    shards down, and AdamW reads 4 and writes 3 arrays like the shards in host memory."""
    if not s.offload:
        return 0.0
    shards = model_state(shape, s)["parameters"]
    gathers = 2 if s.strategy == "fsdp" else 1
    return micro_batches * (gathers + 1) * shards / pcie + 7 * shards / CPU_ADAM_BYTES_PER_S


def ring(n: int) -> float:
    """The share of a buffer each rank sends in a ring all-gather or reduce-scatter of n ranks
    (an all-reduce is both: twice this)."""
    return (n - 1) / n


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on its slowest rank, by what the rank is doing or waiting
    for, and the reference the scaling efficiency compares with."""

    compute: float  # kernels, recomputation included, at the assumed efficiency
    tensor_parallel: float  # all-reduces inside each block: on the critical path
    data_parallel: float  # the part of FSDP's or DDP's collectives the compute does not hide
    data_parallel_traffic: float  # all of their time, hidden or not
    pipeline_sends: float  # activations and their gradients between stages
    bubble: float  # pipeline ranks idle while it fills and drains
    offload: float  # host copies and the CPU optimizer step (CPU offload)
    reference: float  # the step's work spread evenly, each GPU at the one-GPU rate, nothing else
    links: dict[str, str] = field(default_factory=dict)  # which link each group uses

    @property
    def total(self) -> float:
        return (
            self.compute + self.tensor_parallel + self.data_parallel + self.pipeline_sends + self.bubble + self.offload
        )

    @property
    def scaling_efficiency(self) -> float:
        return self.reference / self.total


# ---------------------------------------------------------------------------------------------
# One job, many setups


@dataclass(frozen=True)
class Job:
    """What stays fixed while a plan compares setups: the model, the batch, the device and the
    cluster."""

    shape: ModelShape
    seq_len: int
    global_batch: int
    target: Target
    cluster: Cluster = Cluster()
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def rank_batch(self, s: Setup) -> int:
        return self.global_batch // s.dp

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
            phases = {}
            for stage in self.stages(s):
                phases.update(memory_phases(self.shape, s, self.seq_len, self.rank_batch(s), self.target.kind, stage))
            peak_phase = max(phases, key=lambda name: sum(phases[name].values()))
            allocated = sum(phases[peak_phase].values())
            host = max(sum(model_state(self.shape, s, st).values()) for st in self.stages(s)) if s.offload else 0
            self._cache[key] = MemoryEstimate(
                phases, peak_phase, allocated, overhead_bytes(self.target, s, allocated), host
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
        recompute = RECOMPUTE_TIME if s.activation_checkpointing else 1.0
        head_flops = self.shape.head_flops_per_token
        block_flops = (self.flops_per_token - head_flops) / self.shape.n_layer

        def stage_flops(stage: Stage) -> float:  # per token, on one rank of the stage
            return stage.blocks * block_flops * recompute / s.tp + (head_flops if stage.head else 0.0)

        busiest = max(self.stages(s), key=stage_flops)
        rounds = self.rank_batch(s) // s.micro_batch_size  # micro-batches (pipeline schedules) per step
        m, p, v = s.microbatches, s.pp, s.pp_virtual_stages
        tokens = s.pipeline_micro * self.seq_len  # what a stage computes at once
        act_bytes = 2 if s.autocast else 4
        residual = s.gathered_bytes if s.sharded else 4
        links = {}

        # One slot: a pipeline micro-batch's forward and backward on the busiest rank.
        slot_compute = tokens * stage_flops(busiest) / rate * _micro_batch_time(tokens)
        slot_tp = slot_sends = 0.0
        if s.tp > 1:
            # Column-wise then row-wise projections: an all-reduce of the [tokens, d_model]
            # activations after attention and after the MLP forward, two of their gradients
            # backward, two more when checkpointing recomputes the forward.
            # Forward ones carry the matmuls' 16-bit outputs, backward ones the gradients of the
            # blocks' inputs, in the residual stream's dtype.
            links["tensor_parallel"], bandwidth = c.link(s.tp)
            forward = 4 if s.activation_checkpointing else 2
            per_block = forward * act_bytes + 2 * residual
            slot_tp = busiest.blocks * per_block * 2 * ring(s.tp) * tokens * d / bandwidth
        if p > 1:
            # Each virtual stage sends its output forward and receives its gradient back.
            links["pipeline"], bandwidth = c.link(s.world_size)
            slot_sends = 2 * v * tokens * d * residual / bandwidth
        slot = slot_compute + slot_tp + slot_sends
        round_compute = m * slot_compute

        traffic = exposed = 0.0
        if s.dp > 1:
            links["data_parallel"], bandwidth = c.link(s.tp * s.dp)
            numel = _gathered_numel(busiest.root, s) + busiest.blocks * _gathered_numel(self.shape.block, s)
            if s.sharded:
                # Per micro-batch: all-gathers of the parameters in their compute dtype (forward,
                # and backward again under fsdp), one reduce-scatter of fp32 gradients. In a
                # pipeline backward keeps the parameters gathered and the reduce-scatter waits
                # for the last pipeline micro-batch: fsdp gathers again only for each backward
                # after a forward resharded, fsdp_grad_op once. They overlap the compute, but
                # not the root's and the first block's all-gather before it nor the last
                # reduce-scatters after it.
                gathers = (m if p > 1 else 2) if s.strategy == "fsdp" else 1
                gather = ring(s.dp) * s.gathered_bytes * numel / bandwidth
                scatter = ring(s.dp) * 4 * numel / bandwidth
                edge = _gathered_numel(busiest.root, s) + _gathered_numel(self.shape.block, s)
                unhidden = (gather + scatter) * edge / numel
                per_round = gathers * gather + scatter
                traffic = rounds * per_round
                exposed = rounds * (max(0.0, per_round - round_compute) + unhidden)
            else:
                # DDP all-reduces fp32 gradients once, in buckets during the last micro-batch's
                # backward (2/3 of its compute); a pipeline all at once, after its last schedule.
                traffic = 2 * ring(s.dp) * 4 * numel / bandwidth
                exposed = traffic if p > 1 else max(0.0, traffic - 2 / 3 * round_compute)

        # The same work (recomputation included) on one GPU's micro-batch, spread evenly.
        work = self.global_batch * self.seq_len * ((self.flops_per_token - head_flops) * recompute + head_flops)
        reference = work / (s.world_size * rate) * _micro_batch_time(s.micro_batch_size * self.seq_len)
        return StepTime(
            compute=rounds * m * slot_compute,
            tensor_parallel=rounds * m * slot_tp,
            data_parallel=exposed,
            data_parallel_traffic=traffic,
            pipeline_sends=rounds * m * slot_sends,
            bubble=rounds * (p - 1) / v * slot,
            offload=offload_seconds(self.shape, s, rounds, c.pcie),
            reference=reference,
            links=links,
        )
