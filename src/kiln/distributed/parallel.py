"""The ParallelModel: a model laid out over the world, as the training loop, the optimizer and
the checkpointer see it, whatever the layout.

``kiln.distributed.parallelize`` makes one from a plain model and its family's ``ParallelPlan``.
This module holds the case where each rank runs the model's forward as one module: a single
process, DDP replicas, FSDP2 shards, tensor-parallel splits and their products (the
parallelism is applied to the module in place, from outside). Pipeline parallelism, where each
rank holds some layers, is the other case (``kiln.distributed.pipeline``). The model knows
nothing of either: what to split comes from its plan.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.checkpoint.store import StoredWeights
from kiln.config import ConfigError, ParallelConfig
from kiln.distributed.experts import apply_ep
from kiln.distributed.loss_parallel import VocabParallelCrossEntropy
from kiln.distributed.world import World
from kiln.labels import IGNORE_INDEX
from kiln.models.decode import POSITIONS_MULTIPLE
from kiln.models.family import ParallelPlan
from kiln.models.init import Values


@dataclass(frozen=True)
class Staged:
    """A micro-batch's loss as pipeline stages compute it: ``inputs`` go to the first stage and
    ``keywords`` to every stage, both cut with ``target`` into pieces along their rows;
    ``loss(output, target)`` is a piece's mean loss from the last stage's output and its rows of
    ``target``, and ``count(target)`` what that mean is over (the pieces are weighed by it)."""

    inputs: torch.Tensor
    target: torch.Tensor
    keywords: Mapping[str, Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    count: Callable[[torch.Tensor], torch.Tensor]


class StepCompute(Protocol):
    """What a training step computes with (the loop's ``TrainStep``): the run's loss function and
    precision."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The mean loss of ``batch``, computed by ``model`` under the run's precision."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's precision, for forward passes the loss function does not make."""
        ...

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times fp16's loss scale (itself otherwise), what the backward pass starts from."""
        ...

    def staged(self, model: nn.Module, batch: Any) -> Staged | None:
        """The loss function's own form for pipeline stages (a preference objective's), computed
        with ``model``, the pipeline's forward, where it needs one (a reference's
        log-probabilities); None where the loss is the model's own loss of the batch's targets."""
        ...


class _NoSync(Protocol):
    """A model whose gradient all-reduce can be put off (DDP's ``no_sync``)."""

    def no_sync(self) -> contextlib.AbstractContextManager: ...


class ParallelModel:
    """This rank's share of a model and how one step's work runs on it.

    ``module``: the plain module holding this rank's parameters (sharded or split in place where
    the layout does that): the optimizer, checkpoints and activation checkpointing see it.
    ``whole``: the model as one module whose forward this rank runs (with the other ranks of its
    collectives), or None where it holds only some layers. ``sharded``: checkpoints are written by
    every rank (DCP), each its own part. ``embeddings``: the names of the embedding tables among
    the whole model's parameters (a tied output layer under both names), which take no weight decay.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: ParallelPlan,
        world: World,
        *,
        embeddings: frozenset[str],
        wrapped: nn.Module | None = None,
        sharded: bool = False,
    ):
        self.module, self.plan, self.world, self.embeddings = module, plan, world, embeddings
        # What the loss function calls: a DDP wrapper, whose forward prepares the gradient
        # reduction, or the module itself (under FSDP the module is its own wrapper).
        self.wrapped = wrapped if wrapped is not None else module
        self.sharded = sharded
        self.whole: nn.Module | None = module

    @property
    def eval_forward(self) -> nn.Module:
        """What evaluation calls: ``eval_forward(inputs, targets=targets)`` is the mean loss, and
        ``eval_forward(tokens)`` the logits of rows of any length (a module)."""
        return self.module

    def parameters(self) -> list[torch.Tensor]:
        """This rank's trainable parameters."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def compile(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> Callable[[nn.Module, Any], torch.Tensor]:
        """``loss_fn`` compiled with the forward it calls, so the compiler can fuse the output
        projection with the cross-entropy; the module stays plain and keeps its state-dict names.
        A loss that says ``compiled_by_layer`` (one that runs several forward passes, a
        reference's, and keeps Python state, its metrics) stays eager and each repeated layer
        is compiled instead, with dynamic shapes from the start: such a loss's batches are padded
        to their longest row, so a length-specialized first graph would be thrown away at the
        second length (each graph variant, with and without gradients, compiled twice)."""
        if getattr(loss_fn, "compiled_by_layer", False):
            for block in self.plan.repeated_blocks(self.module):
                block.compile(dynamic=True)
            return loss_fn
        return torch.compile(loss_fn)

    def forward_backward(self, batch: Any, divisor: float, *, last: bool, compute: StepCompute) -> torch.Tensor:
        """Add the gradients of ``loss(batch) / divisor`` to those held; the loss (detached),
        scaled so that its mean over every rank is the batch's. ``last``: the step's last
        micro-batch, after which gradients are reduced over the data-parallel ranks (DDP waits
        for it; FSDP reduces every micro-batch, which keeps its gradients sharded)."""
        with _gradient_sync(self.wrapped, last):
            loss = compute.loss(self.wrapped, batch)
            compute.scaled(loss / divisor).backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients to the global L2 norm ``max_norm``; the norm before clipping."""
        return clip_grad_norm_(self.parameters(), max_norm)

    def load_whole(self, weights: StoredWeights, optim_state: dict[str, Any]) -> dict[str, Any]:
        """Load a whole model's checkpoint (saved unsharded; ``weights`` read on access) into this
        rank's share, one tensor at a time and only the slices it holds, so that no rank holds
        the whole model; the optimizer state as this rank holds it, for the optimizer to load."""
        return load_whole(self.module, weights, optim_state)


# Sequence parallelism's rows are padded to multiples of this many positions (see PaddedRows).
ROW_BUCKET = 64


class PaddedRows:
    """Hooks around a sequence-parallel model's forward (``install``): sequence parallelism splits
    each forward's positions into ``multiple`` equal shares, so rows of any length (a padded
    fine-tuning batch's, a benchmark task's) are padded on the right to a multiple of it, and
    what comes back per position is cut back. Under causal attention the padding changes no
    earlier position's result; its targets and labels are -100 (no loss), its positions follow
    the row's last. The model's arguments are known by name: kiln's GPT's and kiln's wrapper of
    a ``transformers`` model's; the first is the tokens (past a pipeline's first stage, hidden
    states: not padded, the pipeline's rows are as wide as data.seq_len already).

    In training, rows no wider than ``seq_len`` are padded further, to a multiple of ROW_BUCKET
    positions (at most to ``seq_len``'s whole shares): DTensor works out how each
    operation's result is laid out once per operation and shape, and a padded batch's width
    changes at nearly every micro-batch, so that without buckets most of a small model's step
    went into that (a tiny Llama's step over two gloo ranks: 0.55 s -> 0.25 s)."""

    FILL = {
        "idx": 0,
        "input_ids": 0,
        "attention_mask": 0,
        "token_type_ids": 0,
        "targets": IGNORE_INDEX,
        "labels": IGNORE_INDEX,
    }
    POSITIONS = ("positions", "position_ids")
    DECODING = ("kv_cache", "decoding")  # the decoder's cache, given to the model's forward

    def __init__(self, module: nn.Module, multiple: int, seq_len: int | None = None, decoding: int | None = None):
        self.signature, self.multiple = inspect.signature(module.forward), multiple
        # The decoder's passes are not split by context parallelism: sequence parallelism alone
        # splits them, into ``decoding`` shares (the tensor-parallel ranks).
        self.decoding = decoding or multiple
        self.bucket = math.lcm(ROW_BUCKET, multiple)
        self.widest = -(-(seq_len or 0) // multiple) * multiple  # the buckets' end
        self.pads: list[int] = []  # of the forwards under way, innermost last

    def install(self, module: nn.Module) -> None:
        # Outermost: before any other hook's input split (context parallelism's), after its output.
        module.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True)
        module.register_forward_hook(self.after)
        # The decoder pads its forward passes itself, keeping the padding out of its cache's rows.
        setattr(module, POSITIONS_MULTIPLE, self.decoding)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = self.signature.bind(*args, **kwargs)
        tokens = next(iter(bound.arguments.values()))
        decoder = any(bound.arguments.get(name) is not None for name in self.DECODING)
        pad = (
            self.width(tokens.size(1), module.training) - tokens.size(1)
            if tokens.dtype in (torch.int32, torch.int64) and not decoder
            else 0
        )
        self.pads.append(pad)
        if not pad:
            return args, kwargs
        for name, value in bound.arguments.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if name in self.POSITIONS:
                after = value[..., -1:] + torch.arange(1, pad + 1, device=value.device)
                bound.arguments[name] = torch.cat([value, after.to(value.dtype)], dim=-1)
            elif name in self.FILL:
                bound.arguments[name] = F.pad(value, (0, pad), value=self.FILL[name])
        return bound.args, bound.kwargs

    def width(self, positions: int, training: bool) -> int:
        """The padded width of rows of ``positions``: in buckets while training (whose shapes
        recur every step); in evaluation mode whole shares. (The decoder's passes come padded
        already and are left as they are: see ``before``.)"""
        shares = -(-positions // self.multiple) * self.multiple
        if not training:
            return shares
        return max(shares, min(-(-positions // self.bucket) * self.bucket, self.widest))

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        pad = self.pads.pop()
        if not pad or not isinstance(output, torch.Tensor) or output.dim() < 2:
            return output  # a loss
        # Per position: logits or log-probabilities (one fewer for labels: the last has no next).
        return output[:, : output.size(1) - pad]


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP all-reduces gradients only on the last micro-batch of a step (``no_sync`` before it)."""
    if enabled or not hasattr(model, "no_sync"):
        yield
    else:
        with cast(_NoSync, model).no_sync():
            yield


def embedding_names(model: nn.Module) -> frozenset[str]:
    """The names of ``model``'s embedding tables, under every name they have (a tied output layer's too)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return frozenset(name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in tables)


def materialize(module: nn.Module, initial: Values, device: torch.device) -> None:
    """Allocate ``module`` (built on ``meta`` and laid out) on ``device`` and write each tensor's
    initial value, or the slice of it this rank holds: a sharded parameter's whole value is made
    one parameter at a time and cut as its placements say, so a rank holds at most one whole
    parameter beside its shards (the largest is the vocabulary embedding)."""
    initial.materialize(module, device, _place)


@torch.no_grad()
def load_whole(
    module: nn.Module, weights: Mapping[str, torch.Tensor], optim_state: dict[str, Any], *, part: bool = False
) -> dict[str, Any]:
    """Load a whole model's ``weights`` (read on access) into ``module`` as it holds them, and
    return ``optim_state`` (keyed by parameter name) as it holds it. Module by module, each
    tensor is read whole and only this rank's slice of a sharded one (a DTensor) is kept, copied
    through the module's own ``load_state_dict`` (so that its hooks run: a QLoRA base quantizes
    its slice); the whole value is freed before the next is read. ValueError names a tensor the
    module holds and ``weights`` lacks, or, unless ``part`` (``module`` is one pipeline stage of
    the model), one ``weights`` has and the module does not."""
    held = module.state_dict(keep_vars=True)
    missing = sorted(held.keys() - set(weights))
    unexpected = [] if part else sorted(set(weights) - held.keys())
    if missing:
        raise ValueError(f"the model has {missing[0]!r}, which the checkpoint lacks")
    if unexpected:
        raise ValueError(f"the checkpoint has {unexpected[0]!r}, which the model does not")
    for prefix, owner in module.named_modules():
        own = [name for name, _ in owner.named_parameters(recurse=False)]
        own += [name for name, _ in owner.named_buffers(recurse=False)]
        keys = {name: f"{prefix}.{name}" if prefix else name for name in own}
        local = {name: _slice(weights[key], held[key]) for name, key in keys.items() if key in held}
        if local:
            owner.load_state_dict(local, strict=False)
    state = {
        name: {key: _slice(value, held.get(name)) for key, value in per_param.items()}
        for name, per_param in optim_state["state"].items()
    }
    return {**optim_state, "state": state}


def _slice(value: Any, like: torch.Tensor | None) -> Any:
    """This rank's slice of ``value`` (a whole tensor of ``like``'s shape) as a DTensor laid out as
    ``like`` is, or ``value`` itself where ``like`` is not sharded (or ``value`` is another
    shape, such as an optimizer's step count)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor) or value.shape != like.shape:
        return value
    part = distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    # A slice that is contiguous as cut is a view of the whole tensor: copied, so that it is freed.
    return DTensor.from_local(
        part.to_local().clone(), like.device_mesh, like.placements, shape=part.shape, stride=part.stride()
    )


def _place(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (a whole tensor) into ``tensor``, or the slice of it a DTensor holds here."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor):
        local = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(local.to_local())
    else:
        tensor.copy_(value)


def shard(
    module: nn.Module,
    plan: ParallelPlan,
    world: World,
    pcfg: ParallelConfig,
    *,
    bf16: bool,
    fsdp_roots: list[nn.Module] | None = None,
) -> None:
    """Tensor parallelism over the world's "tp" ranks, then FSDP2 over its data-parallel ranks
    (HSDP with ``parallel.dp_replicate``: sharded within each replica; over a group of one, to
    keep the state in CPU memory: ``parallel.cpu_offload``), in place.
    ``fsdp_roots``: the modules FSDP shards as roots, each with its repeated layers (default:
    ``module``)."""
    if world.tp > 1:
        apply_tp(module, plan, world.mesh["tp"])
    experts = plan.block_parts(module, plan.experts) if world.ep > 1 else []
    if experts:
        apply_ep(experts, world.mesh["ep"], plan.experts_call)
    if pcfg.strategy == "ddp" or (world.dp == 1 and not pcfg.cpu_offload):
        return
    for root in fsdp_roots or [module]:
        apply_fsdp(
            root,
            plan,
            world.fsdp_mesh(),
            reshard_after_forward=pcfg.strategy == "fsdp",
            bf16=bf16,
            cpu_offload=pcfg.cpu_offload,
            experts=experts,
            experts_mesh=world.fsdp_mesh(experts=True) if experts else None,
        )


def apply_tp(model: nn.Module, plan: ParallelPlan, tp_mesh: Any) -> None:
    """Lay the model out over the tensor-parallel ranks as its family's styles say (in place):
    the modules outside the repeated layers (``plan.tp_root``), then each layer's
    (``plan.tensor_parallel``); a tied output layer shares the embedding's split weight again;
    and the loss, where the output layer's rows are split, is computed on them
    (``kiln.distributed.loss_parallel``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    assert plan.tensor_parallel is not None  # check_layout refuses tensor parallelism without styles
    tied = _tied_pairs(model)
    # A style's DTensor parameters are new nn.Parameters, trainable whatever the old ones were;
    # frozen ones (a LoRA run's base) stay frozen.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    if plan.tp_root is not None:
        # A pipeline stage holds the embedding, or the output layer, or neither.
        styles = plan.tp_root(model)
        held = {path: styles[end] for end, path in plan.find(model, styles).items()}
        parallelize_module(model, tp_mesh, adapted_styles(model, held))
    for block in plan.repeated_blocks(model):
        parallelize_module(block, tp_mesh, adapted_styles(block, dict(plan.tensor_parallel(block))))
    for name, first in tied:
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    if plan.loss:
        owner, _, leaf = plan.loss.rpartition(".")
        parent = model.get_submodule(owner)
        softcap = getattr(parent, leaf).softcap
        loss = VocabParallelCrossEntropy(softcap, tp_mesh, sequence_parallel=plan.sequence_parallel)
        setattr(parent, leaf, loss)


def adapted_styles(module: nn.Module, styles: Mapping[str, Any]) -> dict[str, Any]:
    """``styles`` (by module path in ``module``) with each that names a LoRA-adapted linear layer
    (PEFT's wrapper: the layer under ``base_layer``, each adapter's two factors under
    ``lora_A.<name>`` and ``lora_B.<name>``) spread over the wrapper's parts, so that the adapted
    layer computes what the plain one would have (Megatron's rule for low-rank adapters): the
    layer split as the style says; of each adapter, the factor on the split side split alike (a
    column-split layer's B by its output columns, a row-split layer's A by its input rows, whose
    partial sums are reduced as the layer's are); the other factor (rank r: small) whole on every
    rank, applied to the positions the layer's input (A) or output (B) holds there. Where those
    are a rank's share of the sequence, its weights are replicated tensors whose gradients are
    summed over the ranks (``SequenceParallel``); where they are every position, each rank
    computes the same gradient and the factor stays a plain tensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    out: dict[str, Any] = {}
    for path, style in styles.items():
        wrapper = module.get_submodule(path)
        if not hasattr(wrapper, "base_layer"):
            out[path] = style
            continue
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or not isinstance(wrapper.base_layer, nn.Linear):
            raise ConfigError(
                [
                    f"lora.target_modules: {path} ({type(wrapper.base_layer).__name__}) is split over tensor-parallel "
                    f"ranks by {type(style).__name__}, which kiln does not spread over LoRA adapters (it does for "
                    "linear layers split by columns or rows); leave it out of lora.target_modules"
                ]
            )
        colwise = isinstance(style, ColwiseParallel)
        # The factor that is not split sees the positions of the layer's input (A) or output (B).
        layout = style.input_layouts[0] if colwise else style.output_layouts[0]
        # B's output is added to the layer's: a DTensor where the layer's is one.
        local = colwise or style.use_local_output
        whole = SequenceParallel(sequence_dim=layout.dim, use_local_output=local) if isinstance(layout, Shard) else None
        out[f"{path}.base_layer"] = style
        split, other = ("lora_B", "lora_A") if colwise else ("lora_A", "lora_B")
        for name in cast(nn.ModuleDict, wrapper.lora_A):
            out[f"{path}.{split}.{name}"] = style
            if whole is not None:
                out[f"{path}.{other}.{name}"] = whole
    return out


def _tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """Each second name of a parameter the model holds under two (a tied output layer), with its first."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            pairs.append((name, first[id(param)]))
    return pairs


def apply_fsdp(
    model: nn.Module,
    plan: ParallelPlan,
    dp_mesh: Any,
    *,
    reshard_after_forward: bool,
    bf16: bool,
    cpu_offload: bool,
    experts: list[nn.Module] | None = None,
    experts_mesh: Any = None,
) -> None:
    """FSDP2 per repeated layer, then the root (embedding, final norm, output layer) as one more
    unit. A model whose plan names no repeated layers is sharded as one unit.

    ``dp_mesh``: the ranks that share the shards (a 2-D mesh for HSDP: replicas, shards).
    ``experts``: modules split over the expert-parallel ranks (``kiln.distributed.experts``),
    sharded separately, over ``experts_mesh`` (the data-parallel ranks that hold the same
    experts), each a unit of its own; where those are one rank, the other units leave them alone.

    Where ranks gather on the host (a gloo mesh), each module of a layer that holds a large
    weight itself (a sixteenth of the layer's parameters or more: its linear layers) is a unit of
    its own inside the layer's: a gather holds three copies of its unit at once there (gloo's flat
    receive buffer, FSDP's all-gather output, the layer's parameters), so smaller units lower the
    peak of host memory (a 1.47B GPT, LoRA, fp32 on 2 CPU ranks: 4.81 GB a rank with one unit a
    layer, 4.33 GB with these). On GPUs a layer stays one unit: fewer, larger collectives, and
    device memory holds one copy the more easily."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": dp_mesh,
        # bf16 compute with fp32 master weights and fp32 gradient reduction.
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    experts = experts or []
    ignored: set[nn.Parameter] | None = None
    for module in experts:
        if experts_mesh.size() > 1:
            fully_shard(module, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": experts_mesh})
        else:
            ignored = (ignored or set()) | set(module.parameters())
    blocks = plan.repeated_blocks(model)
    for i, block in enumerate(blocks):
        for part in host_units(block) if dp_mesh.device_type == "cpu" else []:
            if all(part is not module for module in experts):
                fully_shard(part, reshard_after_forward=reshard_after_forward, ignored_params=ignored, **kwargs)
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, ignored_params=ignored, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, ignored_params=ignored, **kwargs)


def host_units(block: nn.Module) -> list[nn.Module]:
    """The modules of a repeated layer that FSDP shards as units of their own where ranks gather
    on the host (``apply_fsdp``): each that itself holds a weight of a sixteenth of the layer's
    parameters or more (its linear layers); the layer's unit keeps the rest. Not what PEFT's LoRA
    on a parameter wraps (a mixture of experts' fused weights): the wrapper reads the weights
    and its adapters' before their modules' forward, which is where a unit of its own gathers them."""
    size = sum(p.numel() for p in block.parameters())
    wrappers = [w for w in block.modules() if hasattr(w, "lora_A") and hasattr(w, "parameter_name")]
    wrapped = {id(m) for w in wrappers for m in w.modules() if m is not w}
    return [
        part
        for part in block.modules()
        if part is not block
        and id(part) not in wrapped
        and any(16 * p.numel() >= size for p in part.parameters(recurse=False))
    ]


def apply_ddp(model: nn.Module, plan: ParallelPlan, dp_mesh: Any, device: torch.device, bucket_mb: int) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    group = dp_mesh.get_group()
    # DDP's own start broadcasts every parameter and buffer from the first rank, frozen ones
    # too, whose copy would quantize a QLoRA base anew. Every rank builds frozen weights alike;
    # the trainable ones and the buffers are broadcast here instead, so that replicas of a model
    # a user built differently on each rank still start equal.
    broadcast_trainable(model, group)
    # Buffers derived from the config (kiln's RoPE tables) are equal on every rank: no need to
    # broadcast them before every forward (the keyword was renamed in PyTorch 2.13).
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    buffer_sync: dict[str, Any] = {"forward_sync_buffers" if renamed else "broadcast_buffers": not plan.derived_buffers}
    return DistributedDataParallel(
        model,
        # Its replicas are the data-parallel ranks.
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
        init_sync=False,
        **buffer_sync,
    )


@torch.no_grad()
def broadcast_trainable(model: nn.Module, group: Any) -> None:
    """Every trainable parameter and every buffer of ``model`` as the group's first rank has it."""
    import torch.distributed as dist

    source = dist.get_global_rank(group, 0)
    for tensor in [p for p in model.parameters() if p.requires_grad] + list(model.buffers()):
        dist.broadcast(tensor, source, group=group)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP, tensor parallel); a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def is_sharded(model: nn.Module) -> bool:
    """True when parameters are DTensors (FSDP2 or tensor parallel): checkpoints go through DCP."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, group: Any = None, uncounted: Iterable[torch.Tensor] = ()
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

        dtensors: tuple[type[DTensor], ...] = (DTensor,)
    except ImportError:  # a build without distributed support
        dtensors = ()
    layouts: dict[object, list[torch.Tensor]] = defaultdict(list)
    counted: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        assert p.grad is not None  # params keeps those with a gradient
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, dtensors) else None
        layouts[key].append(p.grad)
        if id(p) not in skip:
            counted[key].append(p.grad)
    first = params[0].grad
    assert first is not None  # params keeps those with a gradient
    squares = [torch.zeros((), device=first.device)]
    for members in counted.values():
        norm = torch.nn.utils.get_total_norm(members, 2.0, foreach=True)
        if isinstance(norm, dtensors):
            norm = norm.full_tensor()
        squares.append(norm.float().square())
    total = torch.stack(squares).sum()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
    total = total.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for members in layouts.values():
        locals_ = [g.to_local() if isinstance(g, dtensors) else g for g in members]
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total
