"""``kiln plan``: the memory each device needs for a training run, and its time per step, before
anything is allocated.

The model is built on the ``meta`` device (shapes, no storage), so the parameter, gradient and
optimizer-state bytes are counted from the real parameter list. Activations are counted from
what autograd keeps for the backward pass of kiln's block (pre-norm RMSNorm, q/k/v with RoPE,
SDPA, SwiGLU MLP), tensor by tensor; the figures were checked against live-tensor measurements
of real training steps (tests/observe/test_plan.py). A step's memory is followed through its
phases (end of forward, backward of the output layer, of the last and the first block, of the
embedding, the optimizer step) and the plan reports the largest. Everything below that says "rule of thumb"
is an assumption, not a measurement; docs/plan.md lists them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import re
from dataclasses import dataclass
from typing import Iterator

import torch

from kiln.config import Config, ConfigError, TrainConfig
from kiln.distributed.parallelize import check_tensor_parallel_dims
from kiln.models.flops import PEAK_FLOPS, flops_per_token, gpu_key
from kiln.models.fused_loss import default_chunk_size
from kiln.models.gpt import GPT, GPTConfig
from kiln.models.presets import build_gpt_config
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

# Tensor parallelism splits these projections of each block (see distributed.parallelize.apply_tp):
# the dimension of the weight that is divided among the tp ranks.
_TP_SPLIT = {"attn.wq": 0, "attn.wk": 0, "attn.wv": 0, "mlp.w1": 0, "mlp.w3": 0, "attn.wo": 1, "mlp.w2": 1}

_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """Bytes in "80GB" (10^9), "80GiB" (2^30), "24G" (a bare letter is binary, as in Slurm or
    Docker), "512MB" or a plain number of bytes. Raises ConfigError naming --device-memory."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not match or match.group(2) not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError([f"--device-memory: {text!r} is not a memory size; use e.g. 80GB, 80GiB, 24G, "
                           "512MB or a number of bytes"])
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def gib(n: float) -> float:
    return n / GIB


# ---------------------------------------------------------------------------------------------
# What is planned: the model's shapes, the knobs, the device


@dataclass(frozen=True)
class ModelShape:
    """Parameter shapes of ``GPT(cfg)``, from a model built on the meta device."""

    cfg: GPTConfig
    block: tuple[tuple[str, tuple[int, ...]], ...]  # one block's parameters, named within the block
    root: tuple[tuple[str, tuple[int, ...]], ...]  # embedding, final norm, output layer (a tied matrix once)
    buffer_bytes: int

    @classmethod
    def of(cls, cfg: GPTConfig) -> "ModelShape":
        with torch.device("meta"):
            model = GPT(cfg)
        block, root = [], []
        for name, p in model.named_parameters():  # a tied matrix is listed once
            if name.startswith("blocks.0."):
                block.append((name.removeprefix("blocks.0.").removesuffix(".weight"), tuple(p.shape)))
            elif not name.startswith("blocks."):
                root.append((name.removesuffix(".weight"), tuple(p.shape)))
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        return cls(cfg, tuple(block), tuple(root), buffers)

    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in self.root) + self.cfg.n_layer * sum(math.prod(s) for _, s in self.block)


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

    def overrides(self, base: "Setup") -> list[str]:
        """The ``--set`` items that turn ``base`` into this setup."""
        keys = {"micro_batch_size": "train.micro_batch_size", "precision": "train.precision",
                "activation_checkpointing": "train.activation_checkpointing",
                "strategy": "parallel.strategy", "cpu_offload": "parallel.cpu_offload"}
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


def _local_numel(name: str, shape: tuple[int, ...], s: Setup) -> int:
    """Elements of one parameter on one device: split by tensor parallelism, then sharded along
    dim 0 by FSDP, which pads every shard to the largest (ceil)."""
    dims = list(shape)
    split = _TP_SPLIT.get(name)
    if s.tp > 1 and split is not None:
        dims[split] //= s.tp
    if s.sharded:
        dims[0] = -(-dims[0] // s.dp)
    return math.prod(dims)


def _gathered_numel(params: tuple[tuple[str, tuple[int, ...]], ...], s: Setup) -> int:
    """Elements of a group of parameters once FSDP has all-gathered it (tensor-parallel split kept)."""
    return sum(_local_numel(n, shape, dataclasses.replace(s, strategy="ddp")) for n, shape in params)


def model_state(shape: ModelShape, s: Setup) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state on each device (on the host with CPU
    offload). All three are fp32 in every precision: autocast keeps fp32 master weights, and
    FSDP shards the fp32 originals. AdamW keeps exp_avg and exp_avg_sq like each parameter and
    one fp32 step count per parameter tensor."""
    blocks = shape.cfg.n_layer
    numel = sum(_local_numel(n, sh, s) for n, sh in shape.root) + blocks * sum(
        _local_numel(n, sh, s) for n, sh in shape.block)
    tensors = len(shape.root) + blocks * len(shape.block)
    return {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer_state": 8 * numel + 4 * tensors}


def block_activation_bytes(cfg: GPTConfig, s: Setup, tokens: int) -> int:
    """Bytes one block keeps for its backward pass, for ``tokens`` tokens of a micro-batch.

    Counted per tensor autograd saves (checked against saved-tensor hooks on CPU):
    the block's input and the residual after attention (fp32; bf16 when FSDP gathers bf16
    weights); per RMSNorm, x / rms in fp32 (for its gain's gradient) and 1 / rms; the normed
    input of each projection (under autocast each of the five casts it separately); rotated q,
    k (repeated to every head under GQA), v, SDPA's output and log-sum-exp, and the
    [B, T, heads * head_dim] copy of the output that wo reads; the SwiGLU MLP's w1 x, w3 x,
    silu(w1 x) and their product. Heads and d_ff are divided among tensor-parallel ranks.
    """
    d, tp = cfg.d_model, s.tp
    act = 2 if s.autocast else 4  # what autocast's matmuls return
    residual = s.gathered_bytes if s.sharded else 4
    heads = cfg.n_head // tp
    width = heads * cfg.head_dim  # q, and k and v once repeated to every head
    ff = cfg.d_ff // tp
    per_token = (
        2 * residual * d
        + 2 * (4 * d + 4)
        + (5 if s.autocast else 2) * act * d
        + act * 5 * width + 4 * heads
        + act * 4 * ff
    )
    return tokens * per_token


def _casts_weights(s: Setup) -> bool:
    """Autocast copies fp32 weights to bf16/fp16 and caches the copies until it exits; the
    matmuls' autograd nodes keep them until their backward. bf16 weights gathered by FSDP need
    no copy."""
    return s.autocast and s.gathered_bytes == 4


def _loss_bytes(cfg: GPTConfig, s: Setup, tokens: int) -> tuple[int, int]:
    """kiln's fused output projection + cross-entropy (models/fused_loss.py): what it keeps from
    forward to backward (the fp32 gradients of the hidden states and of the output weight), and
    its largest transient during forward: the final norm's output, and a chunk's [chunk, vocab]
    fp32 logits, which become that chunk's gradient. The next chunk's logits are made while the
    previous chunk's gradient is still held; under autocast they come from low-precision
    logits, and the gradient is cast down again for the two matmuls that use it."""
    d, vocab = cfg.d_model, cfg.vocab_size
    saved = 4 * tokens * d + 4 * vocab * d
    chunk = min(default_chunk_size(vocab), tokens)
    held = 4 * chunk * vocab if tokens > chunk else 0
    low = 2 if s.autocast else 0
    making_logits = held + (4 + low) * chunk * vocab + low * chunk * d
    using_gradient = (4 + low) * chunk * vocab + (low or 4) * chunk * d + low * vocab * d
    return saved, 4 * tokens * (d + 1) + max(making_logits, using_gradient)


def _final_norm_bytes(cfg: GPTConfig, s: Setup, tokens: int) -> int:
    """The final RMSNorm keeps its input (the last block's output), x / rms and 1 / rms."""
    residual = s.gathered_bytes if s.sharded else 4
    return tokens * (residual * cfg.d_model + 4 * cfg.d_model + 4)


@functools.lru_cache(maxsize=None)
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
    return 2 * 4 * max(_local_numel(n, sh, s) for n, sh in shape.root + shape.block)


def memory_phases(shape: ModelShape, s: Setup, seq_len: int, rank_batch: int, device: str) -> dict[str, dict[str, int]]:
    """Bytes on one device at the high points of a training step, component by component.

    ``rank_batch`` is the sequences of one optimizer step on this data-parallel rank (the loop
    holds all of them and splits them into micro-batches). Memory during the backward pass is
    linear in the block being differentiated, so its first and last blocks bound it.
    """
    cfg, blocks = shape.cfg, shape.cfg.n_layer
    tokens = s.micro_batch_size * seq_len
    state = model_state(shape, s)
    on_device = {k: 0 if s.offload else v for k, v in state.items()}
    static = {"parameters": on_device["parameters"], "optimizer_state": on_device["optimizer_state"],
              "model_buffers": shape.buffer_bytes, "batch": rank_batch * seq_len * 2 * 8}  # int64 inputs, targets
    if s.strategy == "ddp" and s.dp > 1:
        static["ddp_gradient_buckets"] = state["gradients"]  # DDP reduces from its own copy of the gradients

    all_grads = on_device["gradients"]
    # Micro-batches after the first of a step start with the gradients of those before.
    held = all_grads if rank_batch > s.micro_batch_size else 0
    block_grads = 0 if s.offload else 4 * sum(_local_numel(n, sh, s) for n, sh in shape.block)
    w2_grad = 0 if s.offload else 4 * _local_numel("mlp.w2", dict(shape.block)["mlp.w2"], s)
    root_grads = all_grads - blocks * block_grads

    act = 2 if s.autocast else 4
    acts = block_activation_bytes(cfg, s, tokens)
    # Activation checkpointing keeps each block's input and recomputes the rest in backward.
    kept = tokens * cfg.d_model * (s.gathered_bytes if s.sharded else 4) if s.activation_checkpointing else acts
    flowing = 4 * tokens * cfg.d_model  # the residual stream's gradient
    loss_saved, loss_transient = _loss_bytes(cfg, s, tokens)

    matrices = tuple(p for p in shape.block if len(p[1]) == 2)
    block_copies = 2 * _gathered_numel(matrices, s) if _casts_weights(s) else 0
    head_copy = 2 * cfg.vocab_size * cfg.d_model if _casts_weights(s) else 0

    def gathered(n_blocks: int) -> int:
        """FSDP keeps the root gathered all step; fsdp reshards a block after its forward and
        prefetches the next (two in flight), fsdp_grad_op keeps blocks until their backward."""
        if not s.sharded:
            return 0
        in_flight = min(n_blocks, 2 if s.strategy == "fsdp" else blocks)
        return s.gathered_bytes * (_gathered_numel(shape.root, s) + in_flight * _gathered_numel(shape.block, s))

    def block_backward(i: int) -> dict[str, int]:
        """At the MLP product's backward in block i: the gradients of w1 x, w3 x and the product
        are alive at once, next to the block's activations and w2's new gradient."""
        grads = (held or root_grads + (blocks - 1 - i) * block_grads) + w2_grad
        if s.activation_checkpointing:
            activations, copies = (i + 1) * kept + acts, block_copies
        else:
            activations, copies = (i + 1) * acts, (i + 1) * block_copies
        # FSDP reduce-scatters a block's gradient from an unsharded fp32 copy.
        reducing = 4 * _gathered_numel(shape.block, s) if s.sharded else 0
        return {**static, "gradients": grads, "gathered_parameters": gathered(i + 1) + reducing,
                "autocast_weight_copies": copies, "activations": activations,
                "backward_workspace": flowing + 2 * act * tokens * (cfg.d_ff // s.tp)}

    forward_end = {**static, "gradients": held, "gathered_parameters": gathered(blocks),
                   "activations": blocks * kept + _final_norm_bytes(cfg, s, tokens)}
    # The embedding's gradient is a new dense tensor. Tied to the output layer, autograd adds the
    # two gradients out of place before storing the sum; earlier micro-batches' one is added to
    # in place.
    embedding_grad = 4 * cfg.vocab_size * cfg.d_model * (2 if cfg.tie_embeddings else 1 if held else 0)
    phases = {
        "forward: output layer and loss": {**forward_end,
                                           "autocast_weight_copies": blocks * block_copies + head_copy,
                                           "output_layer_and_loss": loss_saved + loss_transient},
        # Leaving autocast dropped the weight copies nothing saved (the output layer's; all of
        # them with checkpointing); the loss's backward scales copies of its two saved gradients.
        "backward: output layer": {**forward_end, "output_layer_and_loss": 2 * loss_saved,
                                   "autocast_weight_copies": (0 if s.activation_checkpointing
                                                              else blocks * block_copies)},
        "backward: last block": block_backward(blocks - 1),
        "backward: first block": block_backward(0),
        "backward: embedding": {**static, "gradients": all_grads, "gathered_parameters": gathered(0),
                                "backward_workspace": flowing + embedding_grad},
        "optimizer step": {**static, "gradients": all_grads,
                           "optimizer_workspace": _optimizer_workspace(shape, s, device)},
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
        return flops_per_token(self.shape.cfg, self.seq_len) * self.global_batch * self.seq_len

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


# ---------------------------------------------------------------------------------------------
# Recommendations


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
        layouts = [(strategy, offload) for strategy in ("ddp", "fsdp_grad_op", "fsdp")
                   for offload in ((False, True) if gpu and strategy != "ddp" else (False,))
                   if not (strategy == "ddp" and base.tp > 1)]
    else:  # one data-parallel rank: FSDP matters only to offload
        layouts = [(base.strategy, False)] + [("fsdp", True)] * gpu
    for precision, checkpointing, (strategy, offload) in itertools.product(
            sorted(precisions), sorted({base.activation_checkpointing, True}), layouts):
        s = dataclasses.replace(base, precision=precision, activation_checkpointing=checkpointing,
                                strategy=strategy, cpu_offload=offload, world_size=world_size)
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
    return Recommendation(s, overrides, job.memory(s), seconds, seconds / job.seconds(base),
                          _costs(job, base, s, auto_micro))


def _costs(job: Job, base: Setup, s: Setup, auto_micro: bool) -> list[str]:
    costs = []
    accumulation = job.rank_batch(s) // s.micro_batch_size
    if auto_micro:
        costs.append(f"micro-batch auto: {s.micro_batch_size} fits ({accumulation} per rank and step)")
    elif s.micro_batch_size < base.micro_batch_size:
        costs.append(f"micro-batch {base.micro_batch_size} -> {s.micro_batch_size} ({accumulation} per rank and "
                     "step): the same compute in smaller matmuls, which run less efficiently")
    elif s.micro_batch_size > base.micro_batch_size:
        costs.append(f"micro-batch {base.micro_batch_size} -> {s.micro_batch_size} ({accumulation} per rank and "
                     "step): fewer, larger micro-batches")
    if s.activation_checkpointing and not base.activation_checkpointing:
        costs.append("activation checkpointing recomputes each block's forward: about +33% compute")
    if s.precision != base.precision:
        costs.append("bf16 autocast runs the matmuls on the tensor cores: faster (numerics change slightly)")
    if s.strategy != base.strategy and s.dp > 1:
        costs.append(f"{s.strategy} shards state over the {s.dp} data-parallel ranks: more communication, "
                     f"mostly overlapped (about +{round(100 * (STRATEGY_TIME[s.strategy] - 1))}%)")
    if s.offload:
        extra = offload_seconds(job.shape, s, job.rank_batch(s) // s.micro_batch_size)
        costs.append("CPU offload copies parameters and gradients over PCIe every micro-batch and runs AdamW "
                     f"on the CPU: about +{extra:.1f} s per step")
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
            options = [s for s in _candidates(job, dataclasses.replace(base, strategy="fsdp"), world, auto_micro)
                       if s.strategy == "fsdp" and not s.cpu_offload and job.fits(s)]
            if options:
                return _recommendation(job, base, min(options, key=job.seconds), auto_micro)
        world *= 2
    return None


# ---------------------------------------------------------------------------------------------
# The device, and the plan itself


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
            raise ConfigError([f"--gpu: {gpu!r} is not a GPU kiln knows the peak of; choose one of "
                               f"{', '.join(PEAK_FLOPS)} (models/flops.py)"])
    if local is not None and (key is None or gpu_key(torch.cuda.get_device_name(local)) == key):
        name = torch.cuda.get_device_name(local)
        memory, source = torch.cuda.get_device_properties(local).total_memory, f"{local}, {name}"
        key = gpu_key(name)
    else:
        name = key or "CPU"
        memory, source = _host_memory(), "this machine's RAM" + (" (no such GPU here)" if key else "")
    if device_memory is not None:
        memory, source = parse_memory(device_memory), f"--device-memory {device_memory}"
    return Target("cuda" if key or local is not None else "cpu", name, memory, source,
                  PEAK_FLOPS.get(key) if key else None)


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
        raise ConfigError([f"train.global_batch_size: {t.global_batch_size} is not divisible by the {dp} "
                           "data-parallel ranks (--world-size / parallel.tp)"])
    micro = t.micro_batch_size
    if micro != "auto" and (t.global_batch_size // dp) % micro:
        raise ConfigError([f"train.micro_batch_size: {micro} does not divide each rank's share of the global "
                           f"batch, {t.global_batch_size} / {dp} data-parallel ranks"])
    if dp > 1 and p.strategy == "ddp" and p.tp > 1:
        raise ConfigError(["parallel.strategy: ddp cannot be combined with parallel.tp > 1; use fsdp or fsdp_grad_op"])
    if dp > 1 and p.strategy == "ddp" and p.cpu_offload:
        raise ConfigError(["parallel.cpu_offload: needs parallel.strategy fsdp or fsdp_grad_op"])
    return Setup(1 if micro == "auto" else micro, t.precision, t.activation_checkpointing, p.strategy,
                 p.cpu_offload, world_size, p.tp)


def make_plan(cfg: Config, *, world_size: int = 1, device_memory: str | None = None, gpu: str | None = None) -> Plan:
    """Estimate ``cfg`` on ``world_size`` devices, and what to change if it does not fit.
    Bad input raises ConfigError naming the option or key."""
    target = resolve_target(cfg.run.device, gpu, device_memory)
    base = _base_setup(cfg, world_size)
    gpt_cfg = build_gpt_config(cfg.model, vocab_size=cfg.data.vocab_size, max_seq_len=cfg.data.seq_len)
    check_tensor_parallel_dims(gpt_cfg, base.tp)
    job = Job(ModelShape.of(gpt_cfg), cfg.data.seq_len, cfg.train.global_batch_size, target)
    auto_micro = cfg.train.micro_batch_size == "auto"
    if auto_micro:
        base = largest_fitting_micro_batch(job, base) or base
    memory = job.memory(base)
    recommendations = [] if memory.total <= target.memory else recommend(job, base, auto_micro)
    return Plan(cfg, job, base, auto_micro, memory, recommendations, _notes(cfg, base, target, auto_micro))


def _notes(cfg: Config, s: Setup, target: Target, auto_micro: bool) -> list[str]:
    notes = []
    if auto_micro and needs_fixed_micro_batch(s):
        notes.append("train.micro_batch_size=auto needs one process or DDP; with FSDP or tensor parallelism over "
                     f"several ranks set a number: train.micro_batch_size={s.micro_batch_size} is the largest "
                     "that fits")
    if cfg.data.tokenizer != "bpe":
        notes.append(f"data.tokenizer is a file ({cfg.data.tokenizer}); kiln plan does not read it and takes the "
                     f"vocabulary from data.vocab_size = {cfg.data.vocab_size}: set that to the tokenizer's size")
    if cfg.train.compile:
        notes.append("train.compile=true is not modelled: the estimate is for the eager step (a compiled one "
                     "usually keeps fewer activations)")
    if s.cpu_offload and not s.sharded:
        notes.append("parallel.cpu_offload needs parallel.strategy fsdp or fsdp_grad_op: planned without offload")
    if target.kind == "cuda" and target.peak_flops is None:
        notes.append(f"{target.name}: no peak FLOP/s in models/flops.py PEAK_FLOPS, so no time estimate")
    if target.kind == "cuda" and s.precision == "fp32":
        notes.append("train.precision=fp32 runs matmuls without the bf16 tensor-core rate (PyTorch keeps TF32 off): "
                     f"the time estimate counts it {FP32_TIME:g}x slower")
    return notes


# ---------------------------------------------------------------------------------------------
# Output

LABELS = {
    "parameters": "parameters (fp32)",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state (AdamW, fp32)",
    "ddp_gradient_buckets": "DDP gradient buckets",
    "gathered_parameters": "gathered parameters (FSDP)",
    "activations": "activations",
    "autocast_weight_copies": "autocast weight copies",
    "output_layer_and_loss": "output layer and loss",
    "backward_workspace": "backward workspace",
    "optimizer_workspace": "optimizer workspace",
    "model_buffers": "model buffers (RoPE tables)",
    "batch": "batch (token ids)",
}


def _setup_line(s: Setup, job: Job, auto_micro: bool, fits: bool) -> str:
    micro = f"{s.micro_batch_size}"
    if auto_micro:
        micro += " (auto: the largest that fits)" if fits else " (auto: none fits; shown at 1)"
    accumulation = job.rank_batch(s) // s.micro_batch_size
    return (f"train.micro_batch_size={micro} x {job.seq_len:,} tokens, train.global_batch_size={job.global_batch} "
            f"(accumulation {accumulation}), train.precision={s.precision}\n"
            f"  train.activation_checkpointing={str(s.activation_checkpointing).lower()}, "
            f"parallel.strategy={s.strategy}, parallel.cpu_offload={str(s.cpu_offload).lower()}")


def _overhead_label(target: Target, s: Setup) -> str:
    if target.kind != "cuda":
        return "overhead (the process: Python, libtorch)"
    return "overhead (CUDA context" + (", NCCL" if s.world_size > 1 else "") + f", +{ALLOCATOR_SLACK:.0%} allocator)"


def _row(label: str, value: str, width: int = 48) -> str:
    return f"  {label:<{width}}{value:>14}"


def _unit(total: int) -> tuple[str, int]:
    return ("GiB", GIB) if total >= GIB else ("MiB", 2**20)


def _amount(n: int, unit: tuple[str, int]) -> str:
    return f"{n / unit[1]:,.2f} {unit[0]}"


def format_plan(plan: Plan) -> str:
    job, s, m, target = plan.job, plan.base, plan.memory, plan.job.target
    cfg = job.shape.cfg
    unit = _unit(m.total)
    lines = [
        f"kiln plan: model {plan.config.model.preset}, {job.shape.num_params():,} parameters "
        f"({cfg.n_layer} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size:,} from data.vocab_size)",
        f"  on {s.world_size} x {target.name} (data-parallel {s.dp} x tensor-parallel {s.tp}), "
        f"{gib(target.memory):.2f} GiB each ({target.memory_source})",
        "  " + _setup_line(s, job, plan.auto_micro, plan.fits),
        "",
        f"memory per device at its peak ({m.peak_phase}):",
    ]
    order = list(LABELS)
    for key, value in sorted(m.components.items(), key=lambda kv: order.index(kv[0])):
        lines.append(_row(LABELS[key], _amount(value, unit)))
    lines += [
        _row("tensors at the peak", _amount(m.allocated, unit)),
        _row(_overhead_label(target, s), _amount(m.overhead, unit)),
        _row("total", _amount(m.total, unit)),
        _row("device memory", _amount(target.memory, unit)),
        _row("fits", "yes" if plan.fits else "NO"),
    ]
    if m.host:
        lines.append(_row("host memory per rank (CPU offload)", _amount(m.host, unit)))
    lines += ["", *_time_lines(plan)]
    if not plan.fits:
        lines += ["", *_recommendation_lines(plan)]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _time_lines(plan: Plan) -> list[str]:
    job, s = plan.job, plan.base
    tokens = job.global_batch * job.seq_len
    lines = [f"compute per step: {tokens:,} tokens x {flops_per_token(job.shape.cfg, job.seq_len):.3g} FLOPs "
             f"per token (models/flops.py) = {job.flops_per_step:.3g} FLOPs"]
    bound = job.seconds_at_peak(s.world_size)
    if bound is None:
        lines.append("  no time estimate: the device's peak FLOP/s is unknown (name a GPU with --gpu)")
        return lines
    peak = job.target.peak_flops
    lines.append(_row(f"at 100% of {s.world_size} x {job.target.name} bf16 peak ({peak / 1e12:.0f} TFLOP/s each): "
                      "the MFU bound", f"{bound:.3g} s", width=66))
    lines.append(_row(f"estimated at an assumed {ASSUMED_MFU:.0%} MFU, with this setup's costs",
                      f"{job.seconds(s):.3g} s", width=66))
    return lines


def _recommendation_lines(plan: Plan) -> list[str]:
    if not plan.recommendations:
        return ["does not fit, and no combination kiln plan searches makes it fit"]
    known_time = plan.job.target.peak_flops is not None
    lines = ["does not fit; these changes would (cheapest first; speed costs are rules of thumb):"]
    for i, rec in enumerate(plan.recommendations, 1):
        sets = " ".join(f"--set {o}" for o in rec.overrides)
        where = (f"on {rec.setup.world_size} GPUs: kiln launch --nproc-per-node {rec.setup.world_size} -- train ... "
                 if rec.setup.world_size != plan.base.world_size else "")
        time = f"about {rec.seconds:.3g} s per step, " if known_time else ""
        host = f", {gib(rec.memory.host):.1f} GiB host memory per rank" if rec.memory.host else ""
        lines.append(f"  {i}. {where}{sets}")
        lines.append(f"     {gib(rec.memory.total):.2f} GiB per device{host}; {time}"
                     f"{rec.time_factor:.2f}x the time of the config as given")
        lines += [f"     - {c}" for c in rec.costs]
    return lines


def _memory_json(m: MemoryEstimate) -> dict:
    return {"peak_phase": m.peak_phase, "components": dict(m.components), "tensors": m.allocated,
            "overhead": m.overhead, "total": m.total, "host": m.host,
            "phases": {name: sum(parts.values()) for name, parts in m.phases.items()}}


def plan_json(plan: Plan) -> dict:
    """The plan as one JSON-ready object; memory in bytes, time in seconds."""
    job, s, target = plan.job, plan.base, plan.job.target
    cfg = job.shape.cfg
    known_time = target.peak_flops is not None
    return {
        "model": {"preset": plan.config.model.preset, "parameters": job.shape.num_params(), "n_layer": cfg.n_layer,
                  "d_model": cfg.d_model, "vocab_size": cfg.vocab_size, "seq_len": job.seq_len},
        "device": {"kind": target.kind, "name": target.name, "memory": target.memory,
                   "memory_source": target.memory_source, "peak_flops": target.peak_flops,
                   "world_size": s.world_size, "dp": s.dp, "tp": s.tp},
        "setup": {"micro_batch_size": s.micro_batch_size, "micro_batch_size_auto": plan.auto_micro,
                  "global_batch_size": job.global_batch, "accumulation": job.rank_batch(s) // s.micro_batch_size,
                  "precision": s.precision, "activation_checkpointing": s.activation_checkpointing,
                  "strategy": s.strategy, "cpu_offload": s.cpu_offload},
        "memory": _memory_json(plan.memory),
        "fits": plan.fits,
        "time": {"flops_per_token": flops_per_token(cfg, job.seq_len),
                 "tokens_per_step": job.global_batch * job.seq_len, "flops_per_step": job.flops_per_step,
                 "seconds_at_peak": job.seconds_at_peak(s.world_size),
                 "assumed_mfu": ASSUMED_MFU, "seconds": job.seconds(s) if known_time else None},
        "recommendations": [
            {"overrides": r.overrides, "world_size": r.setup.world_size, "memory": _memory_json(r.memory),
             "fits": True, "seconds": r.seconds if known_time else None, "time_factor": r.time_factor, "costs": r.costs}
            for r in plan.recommendations],
        "notes": plan.notes,
    }
