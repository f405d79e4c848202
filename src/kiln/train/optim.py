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


def build_optimizer(model: nn.Module | ParallelModel, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over a model's trainable parameters, or over this rank's share of a ParallelModel."""
    module, embeddings = (model.module, model.embeddings) if isinstance(model, ParallelModel) else (model, None)
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
