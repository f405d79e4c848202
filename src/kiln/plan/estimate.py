"""The memory each device needs for a training step, and the step's time, before anything is
allocated.

The model is built on the ``meta`` device (shapes, no storage), so the parameter, gradient and
optimizer-state bytes are counted from the real parameter list, split and sharded as the
family's parallel plan and the setup say. What the model keeps for its backward pass comes from
its family's memory model (``kiln.models.MemoryModel``): kiln's GPT counts it tensor by tensor,
checked against live-tensor measurements of real training steps (tests/plan/test_plan.py). A
step's memory is followed through its phases (end of forward, backward of the output layer, of
the last and the first block, of the embedding, the optimizer step) and the plan reports the
largest. Everything below that says "rule of thumb" is an assumption, not a measurement;
docs/plan.md lists them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kiln.config import TrainConfig
from kiln.device import PEAK_FLOPS
from kiln.models.family import MemoryContext, MemoryModel, ModelFamily
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

ASSUMED_MFU = 0.40
RECOMPUTE_TIME = 4 / 3  # activation checkpointing runs each block's forward twice: 3 -> 4 units
FULL_MICRO_TOKENS = 8192  # below this many tokens a micro-batch's matmuls lose efficiency:
SMALL_MICRO_TIME = 0.05  # this much more time per halving
FP32_TIME = 4.0  # fp32 matmuls skip the bf16 tensor-core rate (PyTorch keeps TF32 off)
STRATEGY_TIME = {"ddp": 1.0, "fsdp_grad_op": 1.05, "fsdp": 1.10}  # extra, mostly overlapped traffic
PCIE_BYTES_PER_S = 25e9  # host <-> GPU copies of CPU offload
CPU_ADAM_BYTES_PER_S = 10e9  # memory traffic of the AdamW step when it runs on the CPU
NOMINAL_PEAK_FLOPS = PEAK_FLOPS["H100"]  # orders recommendations when the device's peak is unknown

# ---------------------------------------------------------------------------------------------
# What is planned: the model's shapes, the knobs, the device


class Param(NamedTuple):
    name: str  # within its block, or at the root; without ".weight"
    shape: tuple[int, ...]
    tp_dim: int | None  # the dimension tensor parallelism divides, or None


@dataclass(frozen=True)
class ModelShape:
    """Parameter shapes of a family's model, from the model built on the meta device, and what
    the family says of it: how it splits (its parallel plan), what it keeps (its memory model)."""

    family: ModelFamily
    args: Any
    block: tuple[Param, ...]  # one repeated layer's parameters
    root: tuple[Param, ...]  # the rest: embedding, final norm, output layer (a tied matrix once)
    buffer_bytes: int
    memory: MemoryModel

    @classmethod
    def of(cls, family: ModelFamily, args: Any) -> ModelShape:
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
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        return cls(family, args, block, root, buffers, family.memory_model(args))

    @property
    def n_layer(self) -> int:
        return self.memory.n_layer

    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.root) + self.n_layer * sum(math.prod(p.shape) for p in self.block)

    def flops_per_token(self, seq_len: int) -> float:
        return self.family.flops_per_token(self.args, seq_len)


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

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

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
        under bf16 (MixedPrecisionPolicy); otherwise they are the fp32 master weights."""
        return 2 if self.sharded and self.precision == "bf16" else 4

    def overrides(self, base: Setup) -> list[str]:
        """The ``--set`` items that turn ``base`` into this setup."""
        keys = {
            "micro_batch_size": "train.micro_batch_size",
            "precision": "train.precision",
            "activation_checkpointing": "train.activation_checkpointing",
            "strategy": "parallel.strategy",
            "cpu_offload": "parallel.cpu_offload",
        }
        out = []
        for field, key in keys.items():
            value = getattr(self, field)
            if value != getattr(base, field):
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


# ---------------------------------------------------------------------------------------------
# Memory


def _local_numel(param: Param, s: Setup) -> int:
    """Elements of one parameter on one device: split by tensor parallelism, then sharded along
    dim 0 by FSDP, which pads every shard to the largest (ceil)."""
    dims = list(param.shape)
    if s.tp > 1 and param.tp_dim is not None:
        dims[param.tp_dim] //= s.tp
    if s.sharded:
        dims[0] = -(-dims[0] // s.dp)
    return math.prod(dims)


def _gathered_numel(params: tuple[Param, ...], s: Setup) -> int:
    """Elements of a group of parameters once FSDP has all-gathered it (tensor-parallel split kept)."""
    return sum(_local_numel(p, dataclasses.replace(s, strategy="ddp")) for p in params)


def model_state(shape: ModelShape, s: Setup) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state on each device (on the host with CPU
    offload). All three are fp32 in every precision: autocast keeps fp32 master weights, and
    FSDP shards the fp32 originals. AdamW keeps exp_avg and exp_avg_sq like each parameter and
    one fp32 step count per parameter tensor."""
    blocks = shape.n_layer
    numel = sum(_local_numel(p, s) for p in shape.root) + blocks * sum(_local_numel(p, s) for p in shape.block)
    tensors = len(shape.root) + blocks * len(shape.block)
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


def _optimizer_workspace(shape: ModelShape, s: Setup, device: str) -> int:
    """AdamW's temporaries on the device. The fused kernel has none (nor has the device when the
    step runs on the host); the foreach kernels make sqrt(exp_avg_sq) for every parameter at
    once, the per-parameter loop it and its quotient for one parameter at a time."""
    if s.offload or fused_adamw(device):
        return 0
    if device == "cuda":
        return model_state(shape, s)["parameters"]
    return 2 * 4 * max(_local_numel(p, s) for p in shape.root + shape.block)


def memory_phases(shape: ModelShape, s: Setup, seq_len: int, rank_batch: int, device: str) -> dict[str, dict[str, int]]:
    """Bytes on one device at the high points of a training step, component by component.

    ``rank_batch`` is the sequences of one optimizer step on this data-parallel rank (the loop
    holds all of them and splits them into micro-batches). Memory during the backward pass is
    linear in the block being differentiated, so its first and last blocks bound it.
    """
    blocks, mem = shape.n_layer, shape.memory
    tokens = s.micro_batch_size * seq_len
    ctx = MemoryContext(
        tokens=tokens,
        autocast=s.autocast,
        residual_bytes=s.gathered_bytes if s.sharded else 4,
        tp=s.tp,
        casts_weights=_casts_weights(s),
        seq_len=seq_len,
    )
    state = model_state(shape, s)
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
    # Micro-batches after the first of a step start with the gradients of those before.
    held = all_grads if rank_batch > s.micro_batch_size else 0
    block_grads = 0 if s.offload else 4 * sum(_local_numel(p, s) for p in shape.block)
    peak_grad = next((p for p in shape.block if p.name == mem.backward_peak_grad), None)
    new_grad = 0 if s.offload or peak_grad is None else 4 * _local_numel(peak_grad, s)
    root_grads = all_grads - blocks * block_grads

    acts = mem.block_activations(ctx)
    before = mem.before_blocks(ctx)
    # Activation checkpointing keeps each block's input and recomputes the rest in backward.
    kept = mem.checkpointed_block(ctx) if s.activation_checkpointing else acts
    head = mem.head(ctx)

    matrices = tuple(p for p in shape.block if len(p.shape) == 2)
    block_copies = 2 * _gathered_numel(matrices, s) if ctx.casts_weights else 0
    head_copy = mem.head_weight_copy(ctx)

    def gathered(n_blocks: int) -> int:
        """FSDP keeps the root gathered all step; fsdp reshards a block after its forward and
        prefetches the next (two in flight), fsdp_grad_op keeps blocks until their backward."""
        if not s.sharded:
            return 0
        in_flight = min(n_blocks, 2 if s.strategy == "fsdp" else blocks)
        return s.gathered_bytes * (_gathered_numel(shape.root, s) + in_flight * _gathered_numel(shape.block, s))

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
        "activations": before + blocks * kept + mem.after_blocks(ctx),
    }
    phases = {
        "forward: output layer and loss": {
            **forward_end,
            "autocast_weight_copies": blocks * block_copies + head_copy,
            "output_layer_and_loss": head.saved + head.transient,
        },
        # Leaving autocast dropped the weight copies nothing saved (the output layer's; all of
        # them with checkpointing).
        "backward: output layer": {
            **forward_end,
            "output_layer_and_loss": head.backward,
            "autocast_weight_copies": (0 if s.activation_checkpointing else blocks * block_copies),
        },
        "backward: last block": block_backward(blocks - 1),
        "backward: first block": block_backward(0),
        "backward: embedding": {
            **static,
            "gradients": all_grads,
            "gathered_parameters": gathered(0),
            "backward_workspace": mem.embedding_backward(ctx, accumulating=bool(held)),
        },
        "optimizer step": {
            **static,
            "gradients": all_grads,
            "optimizer_workspace": _optimizer_workspace(shape, s, device),
        },
    }
    return {name: {k: v for k, v in parts.items() if v} for name, parts in phases.items()}


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


def offload_seconds(shape: ModelShape, s: Setup, micro_batches: int) -> float:
    """CPU offload, per step: every all-gather first copies the rank's fp32 shards up (twice
    per micro-batch under fsdp, once under fsdp_grad_op), every reduce-scatter copies gradient
    shards down, and AdamW reads 4 and writes 3 arrays like the shards in host memory."""
    if not s.offload:
        return 0.0
    shards = model_state(shape, s)["parameters"]
    gathers = 2 if s.strategy == "fsdp" else 1
    return micro_batches * (gathers + 1) * shards / PCIE_BYTES_PER_S + 7 * shards / CPU_ADAM_BYTES_PER_S


# ---------------------------------------------------------------------------------------------
# One job, many setups


@dataclass(frozen=True)
class Job:
    """What stays fixed while a plan compares setups: the model, the batch and the device."""

    shape: ModelShape
    seq_len: int
    global_batch: int
    target: Target

    def rank_batch(self, s: Setup) -> int:
        return self.global_batch // s.dp

    def micro_batch_options(self, s: Setup) -> list[int]:
        """Micro-batch sizes that keep the global batch: divisors of each rank's share."""
        rows = self.rank_batch(s)
        return [m for m in range(1, rows + 1) if rows % m == 0]

    def memory(self, s: Setup) -> MemoryEstimate:
        phases = memory_phases(self.shape, s, self.seq_len, self.rank_batch(s), self.target.kind)
        peak_phase = max(phases, key=lambda name: sum(phases[name].values()))
        allocated = sum(phases[peak_phase].values())
        host = sum(model_state(self.shape, s).values()) if s.offload else 0
        return MemoryEstimate(phases, peak_phase, allocated, overhead_bytes(self.target, s, allocated), host)

    def fits(self, s: Setup) -> bool:
        return self.memory(s).total <= self.target.memory

    @property
    def flops_per_step(self) -> float:
        return self.shape.flops_per_token(self.seq_len) * self.global_batch * self.seq_len

    def seconds_at_peak(self, world_size: int) -> float | None:
        """The MFU bound: every device at 100% of its peak, nothing else."""
        peak = self.target.peak_flops
        return self.flops_per_step / (peak * world_size) if peak else None

    def seconds(self, s: Setup) -> float:
        """Estimated time per step at ASSUMED_MFU, with the rule-of-thumb cost of each setting.
        Where the device's peak is unknown, a nominal one still orders setups."""
        compute = self.flops_per_step / ((self.target.peak_flops or NOMINAL_PEAK_FLOPS) * s.world_size * ASSUMED_MFU)
        compute *= _micro_batch_time(s.micro_batch_size * self.seq_len)
        if s.activation_checkpointing:
            compute *= RECOMPUTE_TIME
        if s.precision == "fp32" and self.target.kind == "cuda":
            compute *= FP32_TIME
        if s.dp > 1:
            compute *= STRATEGY_TIME[s.strategy]
        return compute + offload_seconds(self.shape, s, self.rank_batch(s) // s.micro_batch_size)
