"""Parallelism applied to a plain model from outside: tensor parallel, then FSDP2 or DDP.

The model knows nothing of this. What to split comes from its ``ParallelPlan`` (the model
family's, or inferred for a model without one): the repeated layers are FSDP's units, and the
plan's tensor-parallel styles say which projections of each layer split how.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kiln.config import ConfigError, ParallelConfig
from kiln.distributed.world import World
from kiln.models.family import ParallelPlan


def apply_tp(model: nn.Module, plan: ParallelPlan, tp_mesh) -> None:
    """Split every repeated layer's projections as the plan says: column-wise ones produce a
    slice of the features on each rank, row-wise ones take that slice and all-reduce the sum."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layout = {name: styles[style]() for name, style in plan.tensor_parallel.items()}
    for block in plan.repeated_blocks(model):
        parallelize_module(block, tp_mesh, layout)


def apply_fsdp(
    model: nn.Module, plan: ParallelPlan, dp_mesh, *, reshard_after_forward: bool, bf16: bool, cpu_offload: bool
) -> None:
    """FSDP2 per repeated layer, then the root (embedding, final norm, output layer) as one more
    unit. A model whose plan names no repeated layers is sharded as one unit."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": dp_mesh,
        # bf16 compute with fp32 master weights and fp32 gradient reduction.
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    blocks = plan.repeated_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def apply_ddp(model: nn.Module, plan: ParallelPlan, dp_mesh, device: torch.device, bucket_mb: int) -> nn.Module:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # Buffers derived from the config (kiln's RoPE tables) are equal on every rank: no need to
    # broadcast them before every forward (the keyword was renamed in PyTorch 2.13).
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    buffer_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": not plan.derived_buffers}
    # Frozen weights (a LoRA base) have no gradients to reduce and every rank builds them alike:
    # DDP leaves them out, also of its first broadcast, whose copy would quantize a QLoRA base anew.
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return DistributedDataParallel(
        model,
        # Its replicas are the data-parallel ranks (the other ranks of a pipeline hold other layers).
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
        **buffer_sync,
    )


def parallelize(
    model: nn.Module, plan: ParallelPlan, world: World, pcfg: ParallelConfig, *, bf16: bool = False
) -> nn.Module:
    """Return ``model`` ready for ``world``: unchanged in a single process."""
    if world.tp > 1:
        plan.check_tensor_parallel(world.tp, type(model).__name__)
        apply_tp(model, plan, world.mesh["tp"])
    if world.dp == 1 and not pcfg.cpu_offload:
        return model
    if pcfg.strategy == "ddp":
        if world.tp > 1:
            raise ConfigError(
                [
                    "parallel.strategy: ddp cannot be combined with parallel.tp > 1; "
                    "use fsdp or fsdp_grad_op for 2-D (data x tensor) parallelism"
                ]
            )
        if pcfg.cpu_offload:
            raise ConfigError(["parallel.cpu_offload: needs parallel.strategy fsdp or fsdp_grad_op"])
        return apply_ddp(model, plan, world.mesh["dp"], world.device, pcfg.bucket_mb)
    if pcfg.cpu_offload and world.device.type != "cuda":
        raise ConfigError(["parallel.cpu_offload: offloads from a GPU; this run is on the CPU already"])
    mesh = world.mesh if world.distributed else world.mesh_of_one()
    apply_fsdp(
        model, plan, mesh["dp"], reshard_after_forward=pcfg.strategy == "fsdp", bf16=bf16, cpu_offload=pcfg.cpu_offload
    )
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when parameters are DTensors (FSDP2 or tensor parallel): checkpoints go through DCP."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP all-reduces gradients only on the last micro-batch of a step (``no_sync`` before it).
    FSDP keeps reducing every micro-batch, which keeps gradients sharded: that is its point."""
    if enabled or not hasattr(model, "no_sync"):
        yield
    else:
        with model.no_sync():
            yield


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, group=None, uncounted: Iterable[torch.Tensor] = ()
) -> torch.Tensor:
    """Clip to a global L2 norm and return the norm, for plain tensors and DTensors alike.

    Gradients are grouped by how they are laid out (plain, or DTensor of one mesh and placement),
    each group's norm is computed with the foreach kernels (one collective per DTensor group),
    and the groups are combined; plain gradients are replicated, so they count once. ``group``:
    the ranks that each hold other parameters (the stages of a pipeline), whose squares add up;
    ``uncounted``: parameters another rank of ``group`` counts (a copy of a tied weight), clipped
    but left out of the norm."""
    skip = {id(p) for p in uncounted}
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without distributed support
        DTensor = ()  # noqa: N806
    layouts: dict[object, list[torch.Tensor]] = defaultdict(list)
    counted: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        layouts[key].append(p.grad)
        if id(p) not in skip:
            counted[key].append(p.grad)
    squares = [torch.zeros((), device=params[0].grad.device)]
    for members in counted.values():
        norm = torch.nn.utils.get_total_norm(members, 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().square())
    total = torch.stack(squares).sum()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
    total = total.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for members in layouts.values():
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in members]
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total
