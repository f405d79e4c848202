"""Features applied to a plain model from outside: the model file knows nothing of them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.config import ConfigError, LoraConfig
from kiln.models.family import ParallelPlan


def apply_activation_checkpointing(model: nn.Module, plan: ParallelPlan | None = None) -> nn.Module:
    """Recompute each repeated layer's activations during backward instead of keeping them.

    The layers are the plan's (by default: the model's ``blocks``). Each one's ``forward`` is
    replaced on the instance, so parameter names and state dicts stay exactly those of the plain
    model (checkpoints stay interchangeable with and without it).
    """
    blocks = (plan or ParallelPlan.infer(model)).repeated_blocks(model)
    if not blocks:
        raise ValueError(
            "train.activation_checkpointing: the model must expose its repeated layers as an "
            f"nn.ModuleList named `blocks` (or a model family's plan must name them); {type(model).__name__} has none"
        )
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def apply_compile(fn: Callable) -> Callable:
    """Compile ``fn`` (a model, or a loss function that calls one) with torch.compile."""
    return torch.compile(fn)


def apply_lora(model: nn.Module, cfg: LoraConfig, default_targets: list[str], task: str) -> nn.Module:
    """Low-rank adapters (PEFT's LoRA) on a Hugging Face model inside kiln's wrapper (``model.hf``):
    the base weights freeze, only the adapters (and a classifier's new head) train, and the
    adapter saves in PEFT's own format."""
    try:
        import peft
    except ImportError:
        raise ConfigError(["lora.rank: LoRA needs the peft package: pip install 'kiln[hf]'"]) from None
    if not hasattr(model, "hf"):
        raise ConfigError(
            [
                f"lora.rank: LoRA applies to Hugging Face models (model.source = hf:PATH); "
                f"{type(model).__name__} is not one"
            ]
        )
    targets = [name.strip() for name in cfg.target_modules.split(",") if name.strip()] or default_targets
    if not targets:
        raise ConfigError(
            ["lora.target_modules: this model has no default; name the modules to adapt, e.g. q_proj,v_proj"]
        )
    config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        task_type="SEQ_CLS" if task == "sequence_classification" else "CAUSAL_LM",
    )
    try:
        model.hf = peft.get_peft_model(model.hf, config)
    except ValueError as e:
        raise ConfigError([f"lora.target_modules: {str(e).splitlines()[0]}"]) from None
    return model
