"""``kiln plan``'s output: a table for people, one JSON object for scripts."""

from __future__ import annotations

from kiln.observe.memory import GIB
from kiln.plan.estimate import ALLOCATOR_SLACK, ASSUMED_MFU, Job, MemoryEstimate, Setup, Target
from kiln.plan.planner import Plan


def gib(n: float) -> float:
    return n / GIB


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
    "model_buffers": "model buffers",
    "batch": "batch (token ids)",
}


def _setup_line(s: Setup, job: Job, auto_micro: bool, fits: bool) -> str:
    micro = f"{s.micro_batch_size}"
    if auto_micro:
        micro += " (auto: the largest that fits)" if fits else " (auto: none fits; shown at 1)"
    accumulation = job.rank_batch(s) // s.micro_batch_size
    return (
        f"train.micro_batch_size={micro} x {job.seq_len:,} tokens, train.global_batch_size={job.global_batch} "
        f"(accumulation {accumulation}), train.precision={s.precision}\n"
        f"  train.activation_checkpointing={str(s.activation_checkpointing).lower()}, "
        f"parallel.strategy={s.strategy}, parallel.cpu_offload={str(s.cpu_offload).lower()}"
    )


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
    cfg = job.shape.memory
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
        label = LABELS[key] + (f" ({job.shape.memory.buffers})" if key == "model_buffers" else "")
        lines.append(_row(label, _amount(value, unit)))
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
    lines = [
        f"compute per step: {tokens:,} tokens x {job.shape.flops_per_token(job.seq_len):.3g} FLOPs "
        f"per token (the model family's count) = {job.flops_per_step:.3g} FLOPs"
    ]
    bound = job.seconds_at_peak(s.world_size)
    if bound is None:
        lines.append("  no time estimate: the device's peak FLOP/s is unknown (name a GPU with --gpu)")
        return lines
    peak = job.target.peak_flops
    lines.append(
        _row(
            f"at 100% of {s.world_size} x {job.target.name} bf16 peak ({peak / 1e12:.0f} TFLOP/s each): the MFU bound",
            f"{bound:.3g} s",
            width=66,
        )
    )
    lines.append(
        _row(
            f"estimated at an assumed {ASSUMED_MFU:.0%} MFU, with this setup's costs",
            f"{job.seconds(s):.3g} s",
            width=66,
        )
    )
    return lines


def _recommendation_lines(plan: Plan) -> list[str]:
    if not plan.recommendations:
        return ["does not fit, and no combination kiln plan searches makes it fit"]
    known_time = plan.job.target.peak_flops is not None
    lines = ["does not fit; these changes would (cheapest first; speed costs are rules of thumb):"]
    for i, rec in enumerate(plan.recommendations, 1):
        sets = " ".join(f"--set {o}" for o in rec.overrides)
        where = (
            f"on {rec.setup.world_size} GPUs: kiln launch --nproc-per-node {rec.setup.world_size} -- train ... "
            if rec.setup.world_size != plan.base.world_size
            else ""
        )
        time = f"about {rec.seconds:.3g} s per step, " if known_time else ""
        host = f", {gib(rec.memory.host):.1f} GiB host memory per rank" if rec.memory.host else ""
        lines.append(f"  {i}. {where}{sets}")
        lines.append(
            f"     {gib(rec.memory.total):.2f} GiB per device{host}; {time}"
            f"{rec.time_factor:.2f}x the time of the config as given"
        )
        lines += [f"     - {c}" for c in rec.costs]
    return lines


def _memory_json(m: MemoryEstimate) -> dict:
    return {
        "peak_phase": m.peak_phase,
        "components": dict(m.components),
        "tensors": m.allocated,
        "overhead": m.overhead,
        "total": m.total,
        "host": m.host,
        "phases": {name: sum(parts.values()) for name, parts in m.phases.items()},
    }


def plan_json(plan: Plan) -> dict:
    """The plan as one JSON-ready object; memory in bytes, time in seconds."""
    job, s, target = plan.job, plan.base, plan.job.target
    cfg = job.shape.memory
    known_time = target.peak_flops is not None
    return {
        "model": {
            "preset": plan.config.model.preset,
            "parameters": job.shape.num_params(),
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
            "dp": s.dp,
            "tp": s.tp,
        },
        "setup": {
            "micro_batch_size": s.micro_batch_size,
            "micro_batch_size_auto": plan.auto_micro,
            "global_batch_size": job.global_batch,
            "accumulation": job.rank_batch(s) // s.micro_batch_size,
            "precision": s.precision,
            "activation_checkpointing": s.activation_checkpointing,
            "strategy": s.strategy,
            "cpu_offload": s.cpu_offload,
        },
        "memory": _memory_json(plan.memory),
        "fits": plan.fits,
        "time": {
            "flops_per_token": job.shape.flops_per_token(job.seq_len),
            "tokens_per_step": job.global_batch * job.seq_len,
            "flops_per_step": job.flops_per_step,
            "seconds_at_peak": job.seconds_at_peak(s.world_size),
            "assumed_mfu": ASSUMED_MFU,
            "seconds": job.seconds(s) if known_time else None,
        },
        "recommendations": [
            {
                "overrides": r.overrides,
                "world_size": r.setup.world_size,
                "memory": _memory_json(r.memory),
                "fits": True,
                "seconds": r.seconds if known_time else None,
                "time_factor": r.time_factor,
                "costs": r.costs,
            }
            for r in plan.recommendations
        ],
        "notes": plan.notes,
    }
