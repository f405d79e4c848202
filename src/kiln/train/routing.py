"""The mixtures of experts' load: each step, their routing biases move towards an even load
(DeepSeek-V3's auxiliary-loss-free balancing, from the tokens every data-parallel rank routed),
and each logged interval's load goes into the metrics.

A layer takes part by holding ``expert_load`` (pairs of token and expert routed to each expert
since it was last read, counted in training mode), ``dropped`` (those dropped for capacity),
``entropy`` (the sum over tokens of the entropy of the router's scores) and ``k`` (experts a
token), and by ``update_bias(load)``: kiln's GPT's ``MoE`` does. A model without such layers
makes this a no-op. Everything stays on the device until the metrics are logged.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kiln.distributed.world import World


@runtime_checkable
class Routed(Protocol):
    expert_load: torch.Tensor
    dropped: torch.Tensor
    entropy: torch.Tensor
    k: int

    def update_bias(self, load: torch.Tensor) -> None: ...


class ExpertLoad:
    """Balancing after each step and load metrics for the routed layers of ``model``."""

    def __init__(self, model: nn.Module, world: World):
        self.world = world
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Routed)]
        # [layers, experts + 2]: the loads, the drops and the entropy, summed over ranks
        self.interval: torch.Tensor | None = None

    def step_done(self) -> None:
        """After the optimizer's step: the step's loads, summed over the data-parallel ranks (one
        all-reduce for every layer), move each layer's bias; the counts start again."""
        if not self.layers:
            return
        counts = torch.stack([torch.cat([m.expert_load, m.dropped.view(1), m.entropy.view(1)]) for _, m in self.layers])
        self.world.dp_sum(counts)
        for (_, layer), row in zip(self.layers, counts, strict=True):
            layer.update_bias(row[:-2])
            for count in (layer.expert_load, layer.dropped, layer.entropy):
                count.zero_()
        self.interval = counts if self.interval is None else self.interval + counts

    def metrics(self) -> dict[str, Any]:
        """The interval's load since the last call: ``moe/imbalance`` (the largest of any layer's
        busiest expert's load over the mean load), ``moe/min_load`` (the least loaded expert's,
        over the mean), ``moe/router_entropy`` (the mean entropy of a token's scores, in nats: ln
        of n_experts when the router cannot tell them apart), ``moe/dropped`` (the fraction of
        pairs dropped, with a capacity) and ``moe/load`` ({layer: each expert's fraction of its
        pairs}, metrics.jsonl only)."""
        if self.interval is None:
            return {}
        counts, self.interval = self.interval.double().cpu(), None
        load, dropped, entropy = counts[:, :-2], counts[:, -2], counts[:, -1]
        mean = load.mean(-1).clamp_min(1e-12)
        tokens = (load.sum() / self.layers[0][1].k).clamp_min(1)  # every layer's tokens
        record: dict[str, Any] = {
            "moe/imbalance": float((load.max(-1).values / mean).max()),
            "moe/min_load": float((load.min(-1).values / mean).min()),
            "moe/router_entropy": float(entropy.sum() / tokens),
        }
        if dropped.any():
            record["moe/dropped"] = float(dropped.sum() / load.sum())
        shares = load / load.sum(-1, keepdim=True).clamp_min(1e-12)
        rows = zip(self.layers, shares.tolist(), strict=True)
        record["moe/load"] = {name: [round(v, 5) for v in row] for (name, _), row in rows}
        return record
