"""``kiln plan``'s output: a table for people, one JSON object for scripts."""

from __future__ import annotations

from kiln.observe.memory import GIB
from kiln.plan.estimate import (
    ALLOCATOR_SLACK,
    COMPILED_SPEEDUP,
    FP8_SPEEDUP,
    LINKS,
    RECOMPUTE_TIME,
    SELECTIVE_TIME,
    MemoryEstimate,
    Setup,
    StepTime,
    Workload,
)
from kiln.plan.planner import Plan
from kiln.plan.recommend import Recommendation, sequences


def gib(n: float) -> float:
    return n / GIB


LABELS = {
    "parameters": "parameters (fp32)",
    "frozen_parameters": "frozen base weights (LoRA, {stored})",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state (AdamW, fp32)",
    "ddp_gradient_buckets": "DDP gradient buckets",
    "gathered_parameters": "gathered parameters (FSDP)",
    "activations": "activations",
    "pipeline_activations": "activations of other pipeline micro-batches",
    "autocast_weight_copies": "autocast weight copies",
    "output_layer_and_loss": "output layer and loss",
    "backward_workspace": "backward workspace",
    "optimizer_workspace": "optimizer workspace",
    "model_buffers": "model buffers ({buffers})",
    "batch": "batch (token ids)",
}


def _data_split(s: Setup, expert: str, context: str) -> str:
    """How the data-parallel ranks split the experts or the sequences, if they do, and their
    HSDP replicas."""
    replicas = f", {s.dp_replicate} replicas" if s.dp_replicate > 1 else ""
    if s.ep > 1:
        return f" ({expert} {s.ep}{replicas})"
    if s.cp > 1:
        return f" ({context} {s.cp}{replicas})"
    return f" ({s.dp_replicate} replicas)" if replicas else ""


def _layout(s: Setup) -> str:
    split = _data_split(s, "expert-parallel", "context-parallel")
    return f"pipeline {s.pp} x data-parallel {s.dp}{split} x tensor-parallel {s.tp}"


def _layout_keys(s: Setup) -> str:
    keys = [f"parallel.pp={s.pp}", f"parallel.tp={s.tp}"]
    splits = (("ep", s.ep), ("cp", s.cp), ("dp_replicate", s.dp_replicate))
    keys += [f"parallel.{key}={value}" for key, value in splits if value > 1]
    return ", ".join(keys)


def _pipeline(s: Setup) -> str:
    virtual = f", parallel.pp_virtual_stages={s.pp_virtual_stages}" if s.pp_virtual_stages > 1 else ""
    return (
        f"parallel.pp_schedule={s.pp_schedule}{virtual}, parallel.pp_microbatches={s.microbatches} "
        f"({sequences(s.pipeline_micro)} each)"
    )


def _setup_lines(s: Setup, job: Workload, auto_micro: bool, fits: bool) -> list[str]:
    micro = f"{s.micro_batch_size}"
    if auto_micro:
        micro += " (auto: the largest that fits)" if fits else " (auto: none fits; shown at the smallest)"
    accumulation = job.rank_batch(s) // s.micro_batch_size
    lines = [
        f"  layout: {_layout(s)} ({_layout_keys(s)}), parallel.strategy={s.strategy}, "
        f"parallel.cpu_offload={str(s.cpu_offload).lower()}",
        f"  train.micro_batch_size={micro} x {job.seq_len:,} tokens, train.global_batch_size={job.global_batch} "
        f"(accumulation {accumulation}), train.precision={s.precision}, "
        f"train.activation_checkpointing={str(s.checkpointing).lower()}",
    ]
    if s.pp > 1:
        lines.append(f"  pipeline: {_pipeline(s)}")
    return lines


def _frozen_storage(job: Workload, s: Setup) -> str:
    """How a LoRA run's frozen base is stored: in the compute dtype, QLoRA's adapted weights in NF4."""
    return f"NF4 and {s.precision}" if any(p.kind == "nf4" for p in job.shape.block) else s.precision


def _overhead_label(job: Workload, s: Setup) -> str:
    target = job.target
    if target.kind != "cuda":
        return "overhead (the process: Python, PyTorch" + (", transformers, peft)" if job.shape.imports_hf else ")")
    return "overhead (CUDA context" + (", NCCL" if s.world_size > 1 else "") + f", +{ALLOCATOR_SLACK:.0%} allocator)"


def _row(label: str, value: str, width: int = 52) -> str:
    return f"  {label:<{width}}{value:>14}"


def _unit(total: int) -> tuple[str, int]:
    return ("GiB", GIB) if total >= GIB else ("MiB", 2**20)


def _amount(n: int, unit: tuple[str, int]) -> str:
    return f"{n / unit[1]:,.2f} {unit[0]}"


def _devices(job: Workload, world_size: int) -> str:
    nodes = job.cluster.nodes(world_size)
    if job.target.kind != "cuda":
        return f"{world_size} x {job.target.name}"
    per_node = min(world_size, job.cluster.gpus_per_node)
    return f"{world_size} x {job.target.name} ({nodes} node{'s' * (nodes > 1)} x {per_node} GPU{'s' * (per_node > 1)})"


def format_plan(plan: Plan) -> str:
    job, s, m, target = plan.job, plan.base, plan.memory, plan.job.target
    cfg = job.shape.memory
    unit = _unit(m.total)
    lora = f", {job.shape.num_params(('trained',)):,} of them trained (LoRA)" if job.shape.lora else ""
    lines = [
        f"kiln plan: model {plan.config.model.preset}, {job.shape.num_params():,} parameters{lora} "
        f"({cfg.n_layer} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size:,} from data.vocab_size)",
        f"  on {_devices(job, s.world_size)}, {gib(target.memory):.2f} GiB each ({target.memory_source})",
        *_setup_lines(s, job, plan.auto_micro, plan.fits),
        "",
        f"memory per device at its peak ({m.peak_phase}):",
    ]
    order = list(LABELS)
    for key, value in sorted(m.components.items(), key=lambda kv: order.index(kv[0])):
        label = LABELS[key].format(buffers=job.shape.memory.buffers, stored=_frozen_storage(job, s))
        lines.append(_row(label, _amount(value, unit)))
    lines += [
        _row("tensors at the peak", _amount(m.allocated, unit)),
        _row(_overhead_label(job, s), _amount(m.overhead, unit)),
        _row("total", _amount(m.total, unit)),
        _row("device memory", _amount(target.memory, unit)),
        _row("fits", "yes" if plan.fits else "NO"),
        _row("host memory per rank at setup", _amount(m.host_setup, unit)),
    ]
    if m.host:
        lines.append(_row("host memory per rank (CPU offload)", _amount(m.host, unit)))
    lines += ["", *_time_lines(plan)]
    if plan.searched:
        lines += ["", *_recommendation_lines(plan)]
    if target.peak_flops is not None:
        lines += ["", *_assumption_lines(plan)]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _seconds(x: float) -> str:
    return f"{x:.3g} s"


def _time_lines(plan: Plan) -> list[str]:
    job, s, t = plan.job, plan.base, plan.time
    tokens = job.global_batch * job.seq_len
    lines = [
        f"compute per step: {tokens:,} tokens x {job.flops_per_token:.3g} FLOPs per token "
        f"(the model family's count) = {job.flops_per_step:.3g} FLOPs"
    ]
    bound = job.seconds_at_peak(s.world_size)
    if bound is None:
        lines.append("  no time estimate: the device's peak FLOP/s is unknown (name a GPU with --gpu)")
        return lines
    c, peak, width = job.cluster, job.target.peak_flops, 70
    assert peak is not None  # a bound needs the peak
    recompute = f", x{RECOMPUTE_TIME:.3g} blocks recomputed" if s.activation_checkpointing else ""
    recompute += f", x{SELECTIVE_TIME:.3g} cheap operations recomputed" if s.selective else ""
    recompute += f", compiled x{COMPILED_SPEEDUP:.3g}" if s.compiled_steps and job.target.kind == "cuda" else ""
    recompute += f", float8 x{FP8_SPEEDUP:.3g}" if s.precision == "fp8" and job.target.kind == "cuda" else ""
    parts = [(f"compute at {c.efficiency:.0%} of the {peak / 1e12:.0f} TFLOP/s peak{recompute}", t.compute)]
    if s.tp > 1:
        collectives = "all-gathers and reduce-scatters" if job.shape.plan.sequence_parallel else "all-reduces"
        tp_line = f"tensor-parallel {collectives} ({t.links['tensor_parallel']}), not overlapped"
        parts.append((tp_line, t.tensor_parallel))
    if s.ep > 1:
        parts.append((f"expert-parallel all-to-alls ({t.links['expert_parallel']}), not overlapped", t.expert_parallel))
    if s.cp > 1:
        label = f"context-parallel key/value all-gathers ({t.links['context_parallel']}), not overlapped"
        parts.append((label, t.context_parallel))
    if s.dp > 1:
        what = "DDP all-reduce" if not s.sharded else f"{s.strategy} collectives"
        link = t.links["data_parallel"]
        if s.dp_replicate > 1:  # HSDP: the replicas' all-reduces on their own link
            what = f"hsdp collectives over {s.dp_replicate} replicas"
            link = f"{link}; {t.links['data_parallel_replicas']}"
        traffic = _seconds(t.data_parallel_traffic)
        parts.append((f"{what} ({link}): {traffic} in all, not hidden", t.data_parallel))
    if s.pp > 1:
        parts += [
            (f"pipeline sends between stages ({t.links['pipeline']}), not overlapped", t.pipeline_sends),
            (f"pipeline bubble: {bubble_fraction(s):.1%} of the schedule idle", t.bubble),
        ]
    if t.offload:
        parts.append(("CPU offload: PCIe copies and AdamW on the CPU", t.offload))
    mfu = job.mfu(s)
    lines += [
        "estimated time per step, on the busiest rank (rules of thumb, listed below):",
        *(_row(label, _seconds(seconds), width) for label, seconds in parts),
        _row("step time", _seconds(t.total), width),
        _row(
            f"at 100% of {s.world_size} x {job.target.name} bf16 peak ({peak / 1e12:.0f} TFLOP/s each): the MFU bound",
            _seconds(bound),
            width,
        ),
        f"  {tokens / t.total / s.world_size:,.0f} tokens/s per GPU, MFU {mfu:.1%}, scaling efficiency "
        f"{t.scaling_efficiency:.0%} (against one GPU doing its share of the work alone: no communication, "
        "no bubble)",
    ]
    return lines


def bubble_fraction(s: Setup) -> float:
    """The pipeline's idle share of its schedule: (p - 1) / (v m + p - 1)."""
    return (s.pp - 1) / (s.pp_virtual_stages * s.microbatches + s.pp - 1)


def _command(job: Workload, world_size: int) -> str:
    nodes = job.cluster.nodes(world_size)
    per_node = min(world_size, job.cluster.gpus_per_node)
    if nodes == 1:
        return f"kiln launch --nproc-per-node {per_node} -- train ..."
    return f"kiln launch --nnodes {nodes} --nproc-per-node {per_node} --rdzv-endpoint HOST:PORT -- train ..."


def _summary(rec: Recommendation, job: Workload) -> str:
    s = rec.setup
    accumulation = job.rank_batch(s) // s.micro_batch_size
    parts = [
        f"pp {s.pp} x dp {s.dp}{_data_split(s, 'ep', 'cp')} x tp {s.tp}",
        (s.strategy if s.dp > 1 or s.cpu_offload else "no data parallelism")
        + (" + CPU offload" if s.cpu_offload else ""),
        f"checkpointing {'selective' if s.selective else 'on' if s.activation_checkpointing else 'off'}",
        f"micro-batch {s.micro_batch_size} (accumulation {accumulation})",
    ]
    if s.pp > 1:
        parts.append(f"{s.pp_schedule} x {s.microbatches}")
    return ", ".join(parts)


def _recommendation_lines(plan: Plan) -> list[str]:
    job = plan.job
    if not plan.recommendations:
        return ["does not fit, and no setup kiln plan searches makes it fit"]
    known_time = job.target.peak_flops is not None
    where = f"on {_devices(job, plan.base.world_size)}"
    if plan.fits:
        lines = [f"the fastest setups that fit {where} (estimated; docs/plan.md says how they are searched):"]
    else:
        lines = [f"does not fit; the fastest setups that do {where} (estimated; docs/plan.md):"]
    for i, rec in enumerate(plan.recommendations, 1):
        s = rec.setup
        if s == plan.base:
            head = "the config as given"
        else:
            head = " ".join(f"--set {o}" for o in rec.overrides)
            if s.world_size != plan.base.world_size:
                head = f"on {_devices(job, s.world_size)}: {_command(job, s.world_size)} {head}"
        host = f", {gib(rec.memory.host):.1f} GiB host memory per rank" if rec.memory.host else ""
        lines.append(f"  {i}. {head}")
        lines.append(f"     {_summary(rec, job)}")
        if known_time:
            mfu = job.mfu(s)
            speed = (
                f"{rec.seconds:.3g} s per step ({rec.time_factor:.3g}x the config as given), MFU {mfu:.1%}, "
                f"scaling efficiency {rec.time.scaling_efficiency:.0%}"
            )
        else:
            speed = f"{rec.time_factor:.3g}x the time of the config as given"
        lines.append(f"     {gib(rec.memory.total):.2f} GiB per device{host}; {speed}")
        lines += [f"     - {c}" for c in rec.costs]
    return lines


def _assumption_lines(plan: Plan) -> list[str]:
    c = plan.job.cluster
    links = ", ".join(f"{name} {getattr(c, name) / 1e9:.0f} GB/s ({c.source(name)})" for name in LINKS)
    return [
        "assumptions (docs/plan.md):",
        f"  compute efficiency {c.efficiency:.0%} of the dense bf16 peak while nothing waits "
        f"({c.source('efficiency')}; --compute-efficiency)",
        f"  links per GPU and direction (--bandwidth): {links}",
        f"  nodes of {c.gpus_per_node} GPUs: a group of ranks inside a node uses NVLink, one that spans nodes the "
        "network; collectives cost (n-1)/n of their bytes per ring pass",
        "  FSDP's and DDP's collectives overlap compute (what exceeds it shows, and the first all-gather and "
        "last reduce-scatter of each micro-batch); tensor-, expert- and context-parallel collectives and pipeline "
        "sends do not",
    ]


def _memory_json(m: MemoryEstimate) -> dict:
    return {
        "peak_phase": m.peak_phase,
        "components": dict(m.components),
        "tensors": m.allocated,
        "overhead": m.overhead,
        "total": m.total,
        "host": m.host,
        "host_setup": m.host_setup,
        "phases": {name: sum(parts.values()) for name, parts in m.phases.items()},
    }


def _setup_json(s: Setup, job: Workload) -> dict:
    return {
        "micro_batch_size": s.micro_batch_size,
        "global_batch_size": job.global_batch,
        "accumulation": job.rank_batch(s) // s.micro_batch_size,
        "precision": s.precision,
        "activation_checkpointing": s.checkpointing,
        "strategy": s.strategy,
        "cpu_offload": s.cpu_offload,
        "world_size": s.world_size,
        "pp": s.pp,
        "dp": s.dp,
        "tp": s.tp,
        "ep": s.ep,
        "cp": s.cp,
        "pp_schedule": s.pp_schedule if s.pp > 1 else None,
        "pp_microbatches": s.microbatches,
        "pp_virtual_stages": s.pp_virtual_stages if s.pp > 1 else 1,
        "pipeline_micro_batch_size": s.pipeline_micro,
    }


def _time_json(job: Workload, s: Setup, t: StepTime) -> dict:
    """Seconds of each part of a step; null without a known peak."""
    if job.target.peak_flops is None:
        return {"seconds": None, "mfu": None, "scaling_efficiency": None, "tokens_per_second_per_gpu": None}
    return {
        "seconds": t.total,
        "compute": t.compute,
        "tensor_parallel": t.tensor_parallel,
        "expert_parallel": t.expert_parallel,
        "context_parallel": t.context_parallel,
        "data_parallel": t.data_parallel,
        "data_parallel_traffic": t.data_parallel_traffic,
        "pipeline_sends": t.pipeline_sends,
        "bubble": t.bubble,
        "bubble_fraction": bubble_fraction(s),
        "offload": t.offload,
        "reference_seconds": t.reference,
        "links": t.links,
        "tokens_per_second_per_gpu": job.global_batch * job.seq_len / t.total / s.world_size,
        "mfu": job.mfu(s),
        "scaling_efficiency": t.scaling_efficiency,
    }


def plan_json(plan: Plan) -> dict:
    """The plan as one JSON-ready object; memory in bytes, time in seconds, bandwidth in bytes/s."""
    job, s, target, c = plan.job, plan.base, plan.job.target, plan.job.cluster
    cfg = job.shape.memory
    return {
        "model": {
            "preset": plan.config.model.preset,
            "parameters": job.shape.num_params(),
            "trained_parameters": job.shape.num_params(("trained",)),
            "n_layer": cfg.n_layer,
            "d_model": cfg.d_model,
            "vocab_size": cfg.vocab_size,
            "seq_len": job.seq_len,
        },
        "device": {
            "kind": target.kind,
            "name": target.name,
            "memory": target.memory,
            "memory_source": target.memory_source,
            "peak_flops": target.peak_flops,
            "world_size": s.world_size,
            "nodes": c.nodes(s.world_size),
            "gpus_per_node": c.gpus_per_node,
            "pp": s.pp,
            "dp": s.dp,
            "tp": s.tp,
            "ep": s.ep,
            "cp": s.cp,
        },
        "assumptions": {
            "compute_efficiency": c.efficiency,
            "bandwidth": {"nvlink": c.nvlink, "network": c.network, "pcie": c.pcie},
            "sources": dict(c.sources),
        },
        "setup": {**_setup_json(s, job), "micro_batch_size_auto": plan.auto_micro},
        "memory": _memory_json(plan.memory),
        "fits": plan.fits,
        "time": {
            "flops_per_token": job.flops_per_token,
            "tokens_per_step": job.global_batch * job.seq_len,
            "flops_per_step": job.flops_per_step,
            "seconds_at_peak": job.seconds_at_peak(s.world_size),
            **_time_json(job, s, plan.time),
        },
        "recommendations": [
            {
                "overrides": r.overrides,
                "is_config": r.setup == s,
                "world_size": r.setup.world_size,
                "nodes": c.nodes(r.setup.world_size),
                "setup": _setup_json(r.setup, job),
                "memory": _memory_json(r.memory),
                "fits": True,
                "seconds": r.seconds if target.peak_flops is not None else None,
                "time": _time_json(job, r.setup, r.time),
                "time_factor": r.time_factor,
                "costs": r.costs,
            }
            for r in plan.recommendations
        ],
        "notes": plan.notes,
    }
