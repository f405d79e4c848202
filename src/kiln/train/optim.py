"""AdamW with proper parameter groups, and learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import nn

from kiln.config import TrainConfig
from kiln.distributed.parallel import ParallelModel, embedding_names


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

    Under FSDP or tensor parallelism a matrix is a DTensor: its update is gathered whole, every
    rank orthogonalises it, and each keeps its own part. A step is skipped on the device, without
    a host sync, when the non-finite guard sets ``found_inf`` (as on PyTorch's fused optimizers):
    every change is scaled by 1 - found_inf."""

    skips_on_device = True

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "muon": False, "lr_scale": 1.0}
        super().__init__(groups, {**defaults, "momentum": 0.95})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        keep = 1.0 if found_inf is None else 1.0 - found_inf
        for group in self.param_groups:
            lr, decay = group["lr"] * group["lr_scale"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["muon"]:
                    update = self._muon_update(p.grad, state, group["momentum"], keep)
                    scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                else:
                    update = self._adamw_update(p.grad, state, group, keep)
                    scale = 1.0
                p.mul_(1 - lr * decay * keep)
                p.add_(update * (-lr * scale * keep))

    @staticmethod
    def _muon_update(grad: torch.Tensor, state: dict, momentum: float, keep) -> torch.Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, (1 - momentum) * keep)
        return orthogonalize(grad.lerp(buf, momentum))

    @staticmethod
    def _adamw_update(grad: torch.Tensor, state: dict, group: dict, keep) -> torch.Tensor:
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
