"""What to run: every combination of the settings a plan may change (the layout of the world
into pipeline x data-parallel x tensor-parallel ranks, the data-parallel ranks' expert or
context parallelism, the data-parallel strategy, CPU offload, activation checkpointing, bf16,
the micro-batch and the pipeline's schedule), estimated, and the fastest few that fit, each
with what it costs in words."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.plan.estimate import MemoryEstimate, Setup, StepTime, Workload


@dataclass
class Recommendation:
    setup: Setup
    overrides: list[str]  # --set items
    memory: MemoryEstimate
    time: StepTime  # estimated, rules of thumb
    time_factor: float  # relative to the config as given
    costs: list[str]  # what each change costs, in words

    @property
    def seconds(self) -> float:
        return self.time.total


# Above this share of the device's memory a recommendation says its margin is thin.
TIGHT_MEMORY = 0.95


def sequences(n: int) -> str:
    return f"{n} sequence{'s' * (n != 1)}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(job: Workload, base: Setup, world_size: int) -> Iterator[tuple[int, int]]:
    """(pp, tp) degrees the world divides into, leaving a data-parallel degree that divides the
    global batch: stages the model's layers fill equally, tensor parallelism the model can
    split and no wider than a node (unless the config asks for it)."""
    for pp in _divisors(world_size):
        if pp > 1 and not job.shape.pipelines(pp):
            continue
        for tp in _divisors(world_size // pp):
            if job.global_batch % (world_size // (pp * tp)):
                continue
            if tp > 1 and (tp > max(job.cluster.gpus_per_node, base.tp) or not job.shape.splits(tp)):
                continue
            yield pp, tp


def _schedules(job: Workload, base: Setup, pp: int) -> list[tuple[str, int]]:
    """Pipeline schedules with their virtual stages per rank: 1f1b, interleaved 1F1B over two
    stages per rank where the layers allow, and the config's own. gpipe is never faster than
    1f1b (the same bubble) and holds more activations."""
    if pp == 1:
        return [(base.pp_schedule, base.pp_virtual_stages)]
    options = {("1f1b", 1)}
    if job.shape.pipelines(2 * pp):
        options.add(("interleaved_1f1b", 2))
    if base.pp == pp and job.shape.pipelines(base.stages):
        options.add((base.pp_schedule, base.pp_virtual_stages))
    return sorted(options)


def _strategies(job: Workload, base: Setup, dp: int, pp: int, tp: int) -> list[tuple[str, bool]]:
    """(strategy, CPU offload) pairs that kiln runs: DDP not with tensor parallelism
    (kiln.distributed.pipeline); offload only without tensor or pipeline parallelism, on a GPU;
    with one data-parallel rank the strategy matters only to offload."""
    gpu = job.target.kind == "cuda"
    alone = pp == 1 and tp == 1
    if dp > 1:
        return [
            (strategy, offload)
            for strategy in ("ddp", "fsdp_grad_op", "fsdp")
            if strategy != "ddp" or tp == 1
            for offload in ((False, True) if gpu and strategy != "ddp" and alone else (False,))
        ]
    return [(base.strategy, False)] + [("fsdp", True)] * (gpu and alone)


def _data_splits(job: Workload, base: Setup, dp: int, pp: int, strategy: str, offload: bool) -> list[tuple[int, int]]:
    """(ep, cp) degrees that kiln runs on ``dp`` data-parallel ranks, one of them at a time and
    not in a pipeline: expert parallelism for a mixture of experts under FSDP, over degrees that
    divide its experts; context parallelism where the family's plan names the attention, over
    degrees whose 2 x cp chunks divide the sequence, no wider than a node (unless the config asks
    for it). Not with CPU offload, the last resort: that keeps the search small."""
    splits = [(1, 1)]
    if pp > 1 or offload:
        return splits
    plan, widest = job.shape.plan, max(job.cluster.gpus_per_node, base.cp)
    for degree in _divisors(dp)[1:]:
        if plan.experts and strategy != "ddp" and plan.n_experts % degree == 0:
            splits.append((degree, 1))
        if plan.attention and job.seq_len % (2 * degree) == 0 and degree <= widest:
            splits.append((1, degree))
    return splits


def _candidates(job: Workload, base: Setup, world_size: int) -> Iterator[Setup]:
    """The fastest fitting micro-batch of every combination of the changes a plan may
    recommend, for ``world_size`` devices."""
    precisions = {base.precision}
    if job.target.kind == "cuda" and base.precision == "fp32":
        precisions.add("bf16")
    combinations = (
        (pp, tp, schedule, virtual, strategy, offload, ep, cp)
        for pp, tp in _layouts(job, base, world_size)
        for schedule, virtual in _schedules(job, base, pp)
        for strategy, offload in _strategies(job, base, world_size // (pp * tp), pp, tp)
        for ep, cp in _data_splits(job, base, world_size // (pp * tp), pp, strategy, offload)
    )
    for (pp, tp, schedule, virtual, strategy, offload, ep, cp), precision, checkpointing in itertools.product(
        combinations, sorted(precisions), (False, True)
    ):
        s = dataclasses.replace(
            base,
            precision=precision,
            activation_checkpointing=checkpointing,
            selective=base.selective and not checkpointing,
            compiled_steps=base.compiled_steps and not (base.compile_auto and pp > 1),
            strategy=strategy,
            cpu_offload=offload,
            world_size=world_size,
            tp=tp,
            pp=pp,
            pp_schedule=schedule,
            pp_virtual_stages=virtual,
            # The config's own stage sizes fit its own pipeline only.
            pp_layers=base.pp_layers if (pp, virtual) == (base.pp, base.pp_virtual_stages) else (),
            ep=ep,
            cp=cp,
            # HSDP's replicas as the config has them, where they divide the candidate's data-parallel ranks.
            dp_replicate=base.dp_replicate if (world_size // (pp * tp)) % (base.dp_replicate * cp) == 0 else 1,
        )
        fastest = fastest_fitting_micro_batch(job, s)
        if fastest:
            yield fastest


def largest_fitting_micro_batch(job: Workload, s: Setup) -> Setup | None:
    for micro in reversed(job.micro_batch_options(s)):
        candidate = dataclasses.replace(s, micro_batch_size=micro)
        if job.fits(candidate):
            return candidate
    return None


def fastest_fitting_micro_batch(job: Workload, s: Setup) -> Setup | None:
    """Without a pipeline the largest micro-batch that fits is the fastest (fewer collectives,
    larger matmuls). In a pipeline, every micro-batch and count of pipeline micro-batches that
    fit are compared: more of them shrink the bubble, smaller ones compute less efficiently."""
    if s.pp == 1:
        return largest_fitting_micro_batch(job, s)
    fitting = [
        candidate
        for micro in job.micro_batch_options(dataclasses.replace(s, pp_microbatches=s.stages))
        for m in _divisors(micro)
        if m >= s.stages and job.fits(candidate := dataclasses.replace(s, micro_batch_size=micro, pp_microbatches=m))
    ]
    return min(fitting, key=job.seconds, default=None)


def needs_fixed_micro_batch(s: Setup) -> bool:
    """kiln probes for train.micro_batch_size = "auto" only without collectives in the forward
    pass: in one process or under DDP, not with FSDP, tensor, pipeline or context parallelism
    over several ranks."""
    return s.world_size > 1 and (s.strategy != "ddp" or s.tp > 1 or s.pp > 1 or s.cp > 1)


def _recommendation(job: Workload, base: Setup, s: Setup, auto_micro: bool) -> Recommendation:
    overrides = s.overrides(base)
    if auto_micro:  # the run finds the micro-batch itself, where it can
        overrides = [o for o in overrides if not o.startswith("train.micro_batch_size=")]
        if needs_fixed_micro_batch(s):
            overrides.insert(0, f"train.micro_batch_size={s.micro_batch_size}")
    return Recommendation(
        s, overrides, job.memory(s), job.time(s), job.seconds(s) / job.seconds(base), _costs(job, base, s, auto_micro)
    )


def _costs(job: Workload, base: Setup, s: Setup, auto_micro: bool) -> list[str]:
    costs = []
    t = job.time(s)
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
    if s.tp > 1 and s.tp != base.tp:
        sequence = job.shape.plan.sequence_parallel
        collectives = "with sequence parallelism: all-gathers and reduce-scatters" if sequence else "all-reduces"
        costs.append(
            f"tensor parallelism over {s.tp} GPUs ({t.links['tensor_parallel']}) {collectives} inside every "
            f"block, {t.tensor_parallel:.3g} s per step, not overlapped"
        )
    if s.ep > 1 and s.ep != base.ep:
        costs.append(
            f"expert parallelism over {s.ep} GPUs ({t.links['expert_parallel']}): each rank holds 1/{s.ep} of the "
            f"experts; all-to-alls send every token to its experts' ranks and back in every mixture of experts, "
            f"{t.expert_parallel:.3g} s per step, not overlapped"
        )
    if s.cp > 1 and s.cp != base.cp:
        costs.append(
            f"context parallelism over {s.cp} GPUs ({t.links['context_parallel']}): each computes 1/{s.cp} of "
            f"every sequence; all-gathers of keys and values in every block, {t.context_parallel:.3g} s per step, "
            "not overlapped"
        )
    if s.pp > 1 and (s.pp, s.pp_schedule, s.microbatches) != (base.pp, base.pp_schedule, base.microbatches):
        costs.append(
            f"pipeline of {s.pp} stages ({s.pp_schedule}, {s.microbatches} pipeline micro-batches of "
            f"{sequences(s.pipeline_micro)}): idle {t.bubble:.3g} s per step in its bubble"
        )
    if s.dp > 1 and (s.strategy, s.dp) != (base.strategy, base.dp):
        what = "all-reduces gradients" if s.strategy == "ddp" else "shards parameters, gradients and AdamW state"
        costs.append(
            f"{s.strategy} over {s.dp} data-parallel ranks ({t.links['data_parallel']}) {what}: "
            f"{t.data_parallel_traffic:.3g} s of collectives per step, {t.data_parallel:.3g} s not hidden by compute"
        )
    if s.offload:
        costs.append(
            "CPU offload copies parameters and gradients over PCIe every micro-batch and runs AdamW "
            f"on the CPU: about +{t.offload:.1f} s per step"
        )
    share = job.memory(s).total / job.target.memory
    if share > TIGHT_MEMORY:
        costs.append(f"uses {share:.0%} of the device's memory: little margin for what the estimate leaves out")
    return costs


def _keys(overrides: list[str]) -> set[str]:
    return {item.split("=")[0] for item in overrides}


def recommend(
    job: Workload, base: Setup, auto_micro: bool, limit: int = 3, more_gpus: bool = True
) -> list[Recommendation]:
    """The fastest setups that fit on the config's devices, by estimated step time, then fewest
    changes: the config itself among them if it fits; each other one not merely adding changes
    to one listed before it (it would be slower and change more). Then, with ``more_gpus``
    and when nothing fits on one device or on the config's devices, the fewest GPUs that fit."""
    options = set(_candidates(job, base, base.world_size))
    if job.fits(base):
        options.add(base)
    ranked = sorted(options, key=lambda s: (job.seconds(s), len(s.overrides(base)), s.overrides(base)))
    chosen: list[Recommendation] = []
    for s in ranked:
        rec = _recommendation(job, base, s, auto_micro)
        if s != base:
            changed = _keys(rec.overrides)
            if not rec.overrides or any(_keys(c.overrides) <= changed for c in chosen if c.setup != base):
                continue
        chosen.append(rec)
        if len(chosen) == limit:
            break
    if more_gpus and not job.fits(base) and (base.world_size == 1 or not chosen):
        fewest = _fewest_gpus(job, base, auto_micro)
        chosen += [fewest] if fewest else []
    return chosen


def _fewest_gpus(job: Workload, base: Setup, auto_micro: bool, most: int = 4096) -> Recommendation | None:
    """The smallest power-of-two multiple of the world size with a layout that fits without
    offload: the fastest of them."""
    if job.target.kind != "cuda":
        return None
    world = base.world_size * 2
    while world <= most:
        options = [s for s in _candidates(job, base, world) if not s.cpu_offload]
        if options:
            return _recommendation(job, base, min(options, key=job.seconds), auto_micro)
        world *= 2
    return None
