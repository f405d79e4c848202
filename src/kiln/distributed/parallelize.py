"""``parallelize``: the one way a plain model becomes a ``ParallelModel`` for the world's layout.

Which case applies follows from the world (its pipeline, data- and tensor-parallel degrees) and
``[parallel]``: pipeline stages (``kiln.distributed.pipeline``), DDP replicas, or the module
split in place by tensor parallelism and sharded by FSDP2 (``kiln.distributed.parallel``). The
model knows nothing of this: what to split comes from its family's ``ParallelPlan``.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.config import ConfigError, ParallelConfig
from kiln.distributed.context import apply_cp, apply_cp_transformers
from kiln.distributed.parallel import (
    PaddedRows,
    ParallelModel,
    apply_ddp,
    embedding_names,
    is_sharded,
    materialize,
    shard,
)
from kiln.distributed.pipeline import PipelineModel
from kiln.distributed.world import World
from kiln.models.family import TRANSFORMERS_ATTENTION, ParallelPlan
from kiln.models.init import Values


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    world: World,
    pcfg: ParallelConfig,
    *,
    bf16: bool = False,
    initial: Values | None = None,
    seq_len: int | None = None,
) -> ParallelModel:
    """``model`` laid out over ``world`` as ``pcfg`` says (in place), as this rank's ParallelModel;
    in a single process, the model itself. ``bf16``: FSDP computes with bf16 copies of its shards.
    ``initial``: ``model`` is on the ``meta`` device, and each rank allocates and initialises only
    what it holds once the layout is applied (no rank ever holds the whole model); otherwise the
    model is on the device already. ``seq_len``: the widest training rows (see PaddedRows).
    Raises ConfigError, naming the keys, for a layout the model or the strategy cannot take."""
    check_layout(plan, world, pcfg, type(model).__name__)
    # Named before the model is cut: a pipeline stage may hold a tied output layer without its table.
    embeddings = embedding_names(model)
    split = None
    if world.cp > 1 and plan.attention == TRANSFORMERS_ATTENTION:
        split = apply_cp_transformers(model.get_submodule("hf"), world.mesh["cp"])
    elif world.cp > 1:
        split = apply_cp(plan.repeated_blocks(model), plan.attention, world.mesh["cp"])
    if world.pp > 1:  # the split goes around each stage
        return PipelineModel(model, plan, world, pcfg, bf16=bf16, embeddings=embeddings, initial=initial, split=split)
    if split is not None:
        split.install(model)
    if world.tp > 1 and plan.sequence_parallel:
        # Whole shares of positions for tensor parallelism, of context parallelism's chunks too.
        PaddedRows(model, world.tp * (2 * world.cp if world.cp > 1 else 1), seq_len, decoding=world.tp).install(model)
    if pcfg.strategy == "ddp" and world.dp > 1:
        if initial is not None:
            materialize(model, initial, world.device)
        wrapped = apply_ddp(model, plan, world.mesh["dp"], world.device, pcfg.bucket_mb)
        return ParallelModel(model, plan, world, embeddings=embeddings, wrapped=wrapped)
    shard(model, plan, world, pcfg, bf16=bf16)
    if initial is not None:
        materialize(model, initial, torch.device("cpu") if pcfg.cpu_offload else world.device)
    sharded = world.mesh is not None and is_sharded(model)
    return ParallelModel(model, plan, world, embeddings=embeddings, sharded=sharded)


def check_layout(plan: ParallelPlan, world: World, pcfg: ParallelConfig, what: str) -> None:
    """Every reason the layout cannot be applied to the model ``what`` (its class name), at once."""
    errors = []
    if world.pp > 1 and not plan.pipelined:
        errors.append(plan.pipeline_error(what))
    if world.tp > 1:
        try:
            plan.check_tensor_parallel(world.tp, what)
        except ConfigError as e:
            errors += e.errors
    if pcfg.strategy == "ddp" and world.tp > 1 and world.dp > 1:
        errors.append(
            "parallel.strategy: ddp cannot be combined with parallel.tp > 1; "
            "use fsdp or fsdp_grad_op for 2-D (data x tensor) parallelism"
        )
    if pcfg.ep > 1:
        errors += _expert_layout_errors(plan, world, pcfg)
    if pcfg.cp > 1 and not plan.attention:
        errors.append(
            f"parallel.cp: {what} cannot split its sequences over ranks: its family's parallel plan names no "
            "attention for context parallelism (kiln's GPT and Llama-class Hugging Face models do); set parallel.cp=1"
        )
    if pcfg.cp > 1 and world.dp % pcfg.cp:
        errors.append(
            f"parallel.cp: {pcfg.cp} must divide the data-parallel ranks, {world.dp} "
            f"(the world's {world.size} over parallel.pp x parallel.tp = {world.pp} x {world.tp})"
        )
    if pcfg.dp_replicate > 1 and world.dp % (pcfg.dp_replicate * pcfg.cp):
        errors.append(
            f"parallel.dp_replicate: {pcfg.dp_replicate} replicas must divide the data-parallel ranks, {world.dp} "
            f"(the world's {world.size} over parallel.pp x parallel.tp = {world.pp} x {world.tp}"
            + (f", over parallel.cp = {pcfg.cp})" if pcfg.cp > 1 else ")")
        )
    if pcfg.cpu_offload and pcfg.strategy == "ddp":
        errors.append("parallel.cpu_offload: needs parallel.strategy fsdp or fsdp_grad_op")
    elif pcfg.cpu_offload and world.device.type != "cuda":
        errors.append("parallel.cpu_offload: offloads from a GPU; this run is on the CPU already")
    if errors:
        raise ConfigError(errors)


def _expert_layout_errors(plan: ParallelPlan, world: World, pcfg: ParallelConfig) -> list[str]:
    """Why ``parallel.ep`` cannot split this model's experts over this world, if it cannot."""
    if not plan.experts:
        return [
            "parallel.ep: the model has no experts to split: its family's plan names none (kiln's GPT with "
            "model.n_experts > 0 and transformers' fused experts, Qwen3-MoE or Mixtral, do); set parallel.ep=1"
        ]
    errors = []
    if world.dp % pcfg.ep:
        errors.append(
            f"parallel.ep: {pcfg.ep} must divide the data-parallel ranks, {world.dp} "
            f"(the world's {world.size} over parallel.pp x parallel.tp = {world.pp} x {world.tp})"
        )
    if plan.n_experts % pcfg.ep:
        errors.append(
            f"parallel.ep: {pcfg.ep} must divide the model's {plan.n_experts} experts a layer (model.n_experts, or "
            "a Hugging Face model's config.json)"
        )
    if pcfg.strategy == "ddp":
        errors.append("parallel.ep: experts split over ranks need parallel.strategy fsdp or fsdp_grad_op")
    return errors
