"""Mixtures of experts in ``transformers`` models (Qwen3-MoE, Mixtral, ...): the counts kiln's
training loop reads of each router (``kiln.train.routing.Routed``), and the weights a token goes
through, for FLOPs.

A router is found as ``transformers`` itself finds it to record ``router_logits``
(``_can_record_outputs``), and counted by a forward hook, so the model's classes and state dict
stay its own. The hook reads the router's ``(logits, weights, indices)``, the convention of
``transformers``' top-k routers; one whose output is otherwise (checked once, on ``meta``) is
left uncounted. ``transformers``' routers have no balancing bias that kiln could move (DeepSeek-V3's
``e_score_correction_bias`` stays as the checkpoint has it): ``update_bias`` does nothing, and
the counts are only observed.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn


class RouterCounts(nn.Module):
    """The counts of one router since the training loop last read them: ``expert_load`` (the
    (token, expert) pairs routed to each expert), ``dropped`` (always 0: ``transformers``' experts
    drop nothing) and ``entropy`` (the sum over tokens of the entropy of the softmax of the
    router's logits), counted in training mode, on the device. A forward recomputed by activation
    checkpointing counts twice: every count doubles alike, and only the proportions are used."""

    expert_load: torch.Tensor
    dropped: torch.Tensor
    entropy: torch.Tensor

    def __init__(self, n_experts: int, k: int):
        super().__init__()
        self.k = k
        # Not part of the model's state: checkpoints and exports hold the model's own tensors only.
        self.register_buffer("expert_load", torch.zeros(n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("entropy", torch.zeros(()), persistent=False)

    def reset_parameters(self) -> None:
        # A model allocated without values (random weights) has its modules reset: counts start at 0.
        for count in (self.expert_load, self.dropped, self.entropy):
            count.zero_()

    @torch.no_grad()
    def count(self, router: nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
        """The router's forward hook."""
        if not self.training:  # evaluation and generation leave the counts to training
            return
        logits, _, chosen = output
        pairs = chosen.flatten()
        self.expert_load.scatter_add_(0, pairs, torch.ones_like(pairs, dtype=self.expert_load.dtype))
        self.entropy += torch.special.entr(logits.float().softmax(-1)).sum()

    def update_bias(self, load: torch.Tensor) -> None:
        """Nothing: the router has no balancing bias (see the module's docstring)."""


def _router_type(hf: nn.Module) -> type | None:
    """The class ``transformers`` records ``router_logits`` from, where it records them from the
    first element of its output (the top-k routers' logits); else None."""
    recorder = (getattr(hf, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or getattr(recorder, "index", 0) != 0:
        return None
    return getattr(recorder, "target_class", recorder)


def _routing(hf: nn.Module) -> tuple[list[nn.Module], int, int]:
    """``hf``'s routers, its experts and its experts per token (no routers: not a mixture of experts)."""
    config: Any = hf.config
    experts, k = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    router_type = _router_type(hf)
    if not experts or not k or router_type is None:
        return [], 0, 0
    return [m for m in hf.modules() if type(m) is router_type], experts, k


def _conventional(router: nn.Module, hidden: int, experts: int, k: int) -> bool:
    """Whether ``router`` returns (logits [tokens, experts], weights, indices [tokens, k]): tried
    on a copy of it on ``meta``, which computes nothing."""
    probe = copy.deepcopy(router).to("meta")
    dtype = next(probe.parameters(), torch.empty(())).dtype
    try:
        out = probe(torch.empty(2, hidden, device="meta", dtype=dtype))
    except Exception:  # a router that needs more than the hidden states: not one kiln can read
        return False
    return (
        isinstance(out, tuple)
        and len(out) == 3
        and tuple(out[0].shape) == (2, experts)
        and not out[2].is_floating_point()
        and tuple(out[2].shape) == (2, k)
    )


def watch_routers(hf: nn.Module) -> nn.Module:
    """``hf`` with a ``RouterCounts`` under each of its routers (as ``counts``), fed by a forward hook."""
    routers, experts, k = _routing(hf)
    if not routers or not _conventional(routers[0], cast(Any, hf.config).hidden_size, experts, k):
        return hf
    for router in routers:
        counts = RouterCounts(experts, k)
        router.add_module("counts", counts)
        router.register_forward_hook(counts.count)
    return hf


def routed_weights(hf: nn.Module) -> int:
    """The weights of ``hf``'s mixtures of experts that a token goes through: every router's,
    and of the fused experts ([experts, out, in] parameters) the share ``k / experts`` that the
    ``k`` experts it is routed to hold. 0 for a model without routers."""
    routers, experts, k = _routing(hf)
    if not routers:
        return 0
    # A router that is a linear layer is counted with the others.
    plain = [router for router in routers if not isinstance(router, nn.Linear)]
    router_weights = sum(p.numel() for router in plain for p in router.parameters() if p.dim() == 2)
    per_expert = sum(p.numel() // experts for p in hf.parameters() if p.dim() == 3 and p.shape[0] == experts)
    return router_weights + k * per_expert


def split_experts(hf: nn.Module, layer_type: type | None) -> tuple[str, int]:
    """Where a repeated layer of ``hf`` holds experts that expert parallelism can split (their
    path in the layer, e.g. ``mlp.experts``) and how many: ``transformers``' fused experts that
    compute through its experts interface, with gate and up projections concatenated, not
    transposed, without biases or a norm after each expert (Qwen2/3-MoE, Mixtral, OLMoE, ...);
    ("", 0) for any other model."""
    layer = next((m for m in hf.modules() if type(m) is layer_type), None)
    for path, module in layer.named_modules() if layer is not None else ():
        layout = [getattr(module, flag, None) for flag in ("is_concatenated", "is_transposed", "has_bias", "has_gate")]
        post_norm = getattr(module, "has_post_expert_norm", False)
        if hasattr(module, "gate_up_proj") and layout == [True, False, False, True] and not post_norm:
            return path, int(cast(Any, module).num_experts)
    return "", 0
