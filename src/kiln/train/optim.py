"""AdamW with proper parameter groups, and learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from kiln.config import TrainConfig
from kiln.distributed.parallel import ParallelModel, embedding_names

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def param_groups(model: nn.Module, weight_decay: float, embeddings: Collection[str] | None = None) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings are left alone.

    Weight decay pulls weights towards zero; that regularises the linear maps but only hurts
    gains (norms), offsets (biases) and lookup tables (embeddings), which is why GPT-style
    recipes exclude them. ``embeddings``: the names of the embedding tables (by default those of
    ``model``'s ``nn.Embedding`` layers); a tied output layer is one of them under its own name.
    """
    embeddings = embedding_names(model) if embeddings is None else embeddings
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and name not in embeddings else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _one_kind_per_group(groups: list[dict]) -> list[dict]:
    """The fused kernel takes one kind of tensor per group: under tensor parallelism the split
    projections are DTensors and the rest (norms, an untied output layer) plain tensors, so each
    group is divided by kind. A group left empty (LoRA trains no norm or bias) is dropped: torch's
    flattened optimizer state, which sharded checkpoints hold, cannot be loaded into one."""
    out = []
    for group in groups:
        kinds: dict[type, list] = {}
        for p in group["params"]:
            kinds.setdefault(type(p), []).append(p)
        out += [{**group, "params": params} for params in kinds.values()]
    return out


def build_optimizer(model: nn.Module | ParallelModel, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (or Muon with AdamW, train.optimizer) over a model's trainable parameters, or over
    this rank's share of a ParallelModel."""
    module, embeddings = (model.module, model.embeddings) if isinstance(model, ParallelModel) else (model, None)
    if cfg.optimizer == "muon":
        return Muon(muon_groups(module, cfg, embeddings), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    # The fused kernel does the whole update in one pass over each tensor, on CUDA and on the CPU
    # alike (2-6x faster than the foreach kernels on 2 CPU cores, see BENCHMARKS.md), and it can
    # skip a step on the device, which the non-finite guard uses.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        _one_kind_per_group(param_groups(module, cfg.weight_decay, embeddings)),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
    )


def muon_groups(module: nn.Module, cfg: TrainConfig, embeddings: Collection[str] | None = None) -> list[dict]:
    """AdamW's groups, with the hidden weight matrices moved to a Muon group: every decayed matrix
    but those with a vocabulary-sized side (the embeddings and the output layer, tied or not)."""
    embeddings = embedding_names(module) if embeddings is None else embeddings
    named = dict(module.named_parameters())
    vocab = {named[name].shape[0] for name in embeddings if name in named}
    decay, no_decay = param_groups(module, cfg.weight_decay, embeddings)
    hidden = [p for p in decay["params"] if p.ndim == 2 and not vocab & set(p.shape)]
    rest = [p for p in decay["params"] if all(p is not h for h in hidden)]
    groups = [
        {**decay, "params": hidden, "muon": True, "lr_scale": cfg.muon_lr / cfg.lr, "momentum": cfg.muon_momentum},
        {**decay, "params": rest},
        no_decay,
    ]
    return [g for g in groups if g["params"]]


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked ``muon`` (2-D weights: the Nesterov momentum of the gradient,
    orthogonalised by five Newton-Schulz iterations, scaled by sqrt(max(1, rows / columns))), and
    AdamW with decoupled weight decay for the others, in one optimizer, so a checkpoint holds one
    optimizer state as with AdamW. A group's rate is ``lr * lr_scale`` (the schedule sets ``lr``).

    Under FSDP or tensor parallelism a matrix is a DTensor sharded over the ranks of one mesh
    dimension: each matrix's update is orthogonalised once, by one of those ranks (round-robin by
    matrix: an all-to-all brings each owner the shards of its matrix and another sends the result
    back), so n ranks share the work instead of each doing all of it, as distributed Muon
    implementations do (Moonlight; torchtitan's). A matrix sharded over two mesh dimensions (FSDP
    with tensor parallelism) is gathered whole and orthogonalised on every rank. A step is skipped
    on the device, without a host sync, when the non-finite guard sets ``found_inf`` (as on
    PyTorch's fused optimizers): every change is scaled by 1 - found_inf."""

    skips_on_device = True

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "muon": False, "lr_scale": 1.0}
        super().__init__(groups, {**defaults, "momentum": 0.95})

    # No closure is evaluated and no loss returned (Optimizer's overloads promise one for a closure).
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        found_inf = getattr(self, "found_inf", None)
        keep = 1.0 if found_inf is None else 1.0 - found_inf
        # The Muon matrices' momentum first, then their orthogonalisation, all together: each
        # sharded one by one owner rank.
        muon = [
            (p, group) for group in self.param_groups if group["muon"] for p in group["params"] if p.grad is not None
        ]
        nesterov = [self._momentum(p.grad, self.state[p], group["momentum"], keep) for p, group in muon]
        updates = dict(zip([p for p, _ in muon], orthogonalize_all(nesterov), strict=True))
        for group in self.param_groups:
            lr, decay = group["lr"] * group["lr_scale"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    update = updates[p]
                    scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                else:
                    update = self._adamw_update(p.grad, self.state[p], group, keep)
                    scale = 1.0
                p.mul_(1 - lr * decay * keep)
                p.add_(update * (-lr * scale * keep))

    @staticmethod
    def _momentum(grad: torch.Tensor, state: dict, momentum: float, keep: float | torch.Tensor) -> torch.Tensor:
        """The Nesterov momentum of ``grad`` (the buffer updated): what Muon orthogonalises."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, (1 - momentum) * keep)
        return grad.lerp(buf, momentum)

    @staticmethod
    def _adamw_update(grad: torch.Tensor, state: dict, group: dict, keep: float | torch.Tensor) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=grad.device)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(grad), torch.zeros_like(grad)
        state["step"] += keep
        step = state["step"].clamp(min=1)  # a skipped first step leaves no update to correct
        state["exp_avg"].lerp_(grad, (1 - beta1) * keep)
        state["exp_avg_sq"].lerp_(grad * grad, (1 - beta2) * keep)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt() + group["eps"]
        return state["exp_avg"] / (1 - beta1**step) / denom


def orthogonalize_all(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``updates`` orthogonalised: a plain tensor or one sharded over two mesh dimensions
    by ``orthogonalize``; those sharded over one mesh dimension (the others replicated), in
    rounds of one matrix per rank of that dimension's group (``_orthogonalize_round``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out: list[torch.Tensor | None] = [None] * len(updates)
    spread: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        if isinstance(u, DTensor):
            sharded = [d for d, pl in enumerate(u.placements) if isinstance(pl, Shard)]
            rest = [pl for d, pl in enumerate(u.placements) if d not in sharded]
            if (
                len(sharded) == 1
                and all(isinstance(pl, Replicate) for pl in rest)
                and u.device_mesh.size(sharded[0]) > 1
            ):
                spread.setdefault((id(u.device_mesh), sharded[0]), []).append(i)
                continue
        out[i] = orthogonalize(u)
    for (_, dim), members in spread.items():
        n = cast(DTensor, updates[members[0]]).device_mesh.size(dim)
        for start in range(0, len(members), n):
            batch = members[start : start + n]
            round_ = [cast(DTensor, updates[i]) for i in batch]
            for i, result in zip(batch, _orthogonalize_round(round_, dim), strict=True):
                out[i] = result
    return cast("list[torch.Tensor]", out)


def _orthogonalize_round(updates: list[DTensor], mesh_dim: int) -> list[torch.Tensor]:
    """Up to n DTensors sharded over mesh dimension ``mesh_dim`` (n ranks), matrix j
    orthogonalised by rank j: one all-to-all sends every rank's shards to their owners, the
    owner joins and orthogonalises its matrix, another all-to-all sends the shards back."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    mesh = updates[0].device_mesh
    group, n, rank = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    dims = [cast(Shard, u.placements[mesh_dim]).dim for u in updates]
    # Every rank's shard of each matrix, the sharded dimension first: torch.chunk's cut, as DTensor's.
    moved = [
        tuple(u.shape[d : d + 1]) + tuple(s for k, s in enumerate(u.shape) if k != d)
        for u, d in zip(updates, dims, strict=True)
    ]
    rows = [[len(c) for c in torch.empty(shape[0], device="meta").chunk(n)] for shape in moved]
    rows = [r + [0] * (n - len(r)) for r in rows]
    width = [math.prod(shape[1:]) for shape in moved]
    mine = [u.to_local().movedim(d, 0).reshape(-1) for u, d in zip(updates, dims, strict=True)]
    k = len(updates)
    send = torch.cat(mine)
    sent = [t.numel() for t in mine] + [0] * (n - k)
    owned = rank < k
    received = [rows[rank][r] * width[rank] for r in range(n)] if owned else [0] * n
    gathered = send.new_empty(sum(received))
    dist.all_to_all_single(gathered, send, received, sent, group=group)
    back = send.new_empty(sum(sent))
    if owned:
        whole = orthogonalize(gathered.view(moved[rank]))
        result = whole.reshape(-1)
    else:
        result = send.new_empty(0)
    dist.all_to_all_single(back, result, sent, received, group=group)
    out: list[torch.Tensor] = []
    for j, (u, d) in enumerate(zip(updates, dims, strict=True)):
        local_shape = (rows[j][rank],) + moved[j][1:]
        piece = back[sum(sent[:j]) : sum(sent[: j + 1])].view(local_shape).movedim(0, d)
        out.append(DTensor.from_local(piece, mesh, u.placements, shape=u.shape, stride=u.stride()))
    return out


def orthogonalize(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``update``, approximately: Keller Jordan's quintic
    Newton-Schulz iteration (the coefficients of Muon's reference). A DTensor is gathered whole,
    orthogonalised on every rank, and cut back to its placements."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(update, DTensor):
        mesh, placements = update.device_mesh, update.placements
        whole = orthogonalize(update.full_tensor(), steps, eps)
        return DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(torch.bfloat16 if update.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(update.dtype)


def lr_at(step: int, cfg: TrainConfig, max_steps: int | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then the schedule over
    ``max_steps`` (``train.max_steps`` unless given: a time plan's steps for "auto")."""
    steps = cfg.max_steps if max_steps is None else max_steps
    assert isinstance(steps, int), "train.max_steps=auto: give the planned steps"
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    # The last step (max_steps - 1) trains at the final rate: the run ends at the schedule's end.
    total = max(1, steps - cfg.warmup_steps - 1)
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * steps))
        decay_start = steps - decay_steps
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return peak + (floor - peak) * progress
    progress = min(1.0, (step - cfg.warmup_steps) / total)
    if cfg.schedule == "linear":
        return peak + (floor - peak) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
