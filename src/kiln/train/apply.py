"""Features applied to a plain model from outside: the model file knows nothing of them."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.config import Config, ConfigError
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


def apply_lora(model: nn.Module, cfg: Config, targets: list[str]) -> nn.Module:
    """Low-rank adapters (PEFT's LoRA) when ``lora.rank`` is set: the base weights freeze and only
    the adapters (and a classifier's new head) train. A Hugging Face model inside kiln's wrapper
    (``model.hf``) becomes a PEFT model, whose adapter saves in PEFT's own format; any other
    model (kiln's GPT) keeps its class, with the adapted layers replaced in place, so its family's
    parallel plan and calling convention still apply. ``targets``: the family's default modules."""
    lora = cfg.lora
    if not lora.rank:
        return model
    try:
        import peft
    except ImportError:
        raise ConfigError(["lora.rank: LoRA needs the peft package: pip install 'kiln[hf]'"]) from None
    targets = [name.strip() for name in lora.target_modules.split(",") if name.strip()] or targets
    if not targets:
        raise ConfigError(
            ["lora.target_modules: this model has no default; name the modules to adapt, e.g. q_proj,v_proj"]
        )
    hf = getattr(model, "hf", None)
    task = {"sequence_classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}.get(cfg.model.task) if hf else None
    config = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type=task
    )
    try:
        if hf is not None:
            model.hf = peft.get_peft_model(hf, config)
        else:
            peft.inject_adapter_in_model(config, model)
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name)
    except ValueError as e:
        raise ConfigError([f"lora.target_modules: {str(e).splitlines()[0]}"]) from None
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every LoRA adapter folded into its layer's weight and the plain
    layer put back: the model its family's exporters know (``model`` itself if it has none)."""
    hf = getattr(model, "hf", None)
    if hf is not None and hasattr(hf, "merge_and_unload"):
        merged = copy.deepcopy(model)
        merged.hf = merged.hf.merge_and_unload()
        return merged
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    if not adapted:
        return model
    merged = copy.deepcopy(model)
    for name in adapted:
        layer = merged.get_submodule(name)
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(merged.get_submodule(parent), child, layer.get_base_layer())
    return merged
