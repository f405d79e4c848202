"""The mixture-of-experts layer of kiln's GPT: a router picks ``experts_per_token`` of
``n_experts`` SwiGLU experts for each token, beside ``n_shared_experts`` that every token goes
through (DeepSeek's shared experts, as one wider SwiGLU).

Routing. The router's scores are the softmax (or sigmoid) of its logits; the top-k experts are
chosen by score plus a per-expert bias, and weighted by their scores alone, renormalized to sum
to 1 when k > 1 (as Qwen3-MoE, Mixtral and DeepSeek-V3 do). The bias is DeepSeek-V3's
auxiliary-loss-free balancing: after each optimizer step it moves by ``router_bias_rate`` towards
the experts that got fewer tokens than the mean (``update_bias``, called by the training loop
with the step's loads summed over the data-parallel ranks), so it steers the choice without a
gradient; it is a buffer, kept in checkpoints. ``router_aux_loss`` adds the Switch Transformer's
balance loss (``n_experts * sum_e f_e * P_e``: the fraction of routed tokens each expert got
times its mean score) to the training loss, scaled by that coefficient.

Dispatch. The (token, expert) pairs are sorted by expert, each expert's rows go through its
weights in one grouped matrix multiply (``grouped_mm``), and the results are put back in the
pairs' order and summed per token: no loop over tokens, nothing dropped. With
``expert_capacity`` (a factor of the even share ``tokens * k / n_experts``) the pairs beyond an
expert's capacity, in token order, are dropped: their weight is zero.

In training mode each layer counts the pairs routed to each expert (``expert_load``) and those
dropped, and sums the entropy of each token's scores (normalized to sum to 1: ``entropy``), on
the device, for balancing and metrics; the training loop reads and resets them once a step. A
forward recomputed by activation checkpointing counts twice: every count doubles alike, and
only the proportions are used.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _native_grouped_mm(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``x``'s device and dtype here.

    It is a private operator (PyTorch has no public grouped GEMM yet), used only through
    ``grouped_mm``; ``tests/models/test_moe.py`` fails loudly if it changes. CUDA has it for
    bf16 from Hopper on; the CPU runs it for any float type on plain tensors in eager mode, but
    its shape function, which the compiler, ``torch.export`` and fake tensors run, accepts only
    bf16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    eager = not torch.compiler.is_compiling() and type(x) is torch.Tensor
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16 or eager)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, *, native: bool = True) -> torch.Tensor:
    """Rows of ``x`` [N, d_in], grouped by expert (expert e's rows end at ``ends[e]``, int32),
    each times its expert's ``weight[e]`` [d_out, d_in] transposed: [N, d_out]. One grouped GEMM
    where the build has it; otherwise (or ``native=False``) a loop over the experts, which needs
    the group sizes on the host."""
    if torch.is_autocast_enabled(x.device.type):  # the grouped GEMM has no autocast rule of its own
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    weight = weight.to(x.dtype)
    if native and _native_grouped_mm(x):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([rows @ w.T for rows, w in zip(x.split(sizes), weight, strict=True)])


class Experts(nn.Module):
    """``n_experts`` SwiGLU MLPs of hidden size ``d_expert``, their weights stacked: ``w1`` and
    ``w3`` [n_experts, d_expert, d_model], ``w2`` [n_experts, d_model, d_expert] (each expert's
    as ``nn.Linear`` stores it)."""

    residual = ("w2",)  # each expert's output projection, into the residual stream

    def __init__(self, n_experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.native = True  # False: the loop over experts (benchmarks compare the two)

    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``x`` [N, d_model], rows grouped by expert as ``ends`` says. Under expert parallelism
        the weights are split over ranks by their first dimension and the rows are this rank's
        experts' (``kiln.distributed.experts``): each weight's local part is the one used."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        hidden = F.silu(grouped_mm(x, w1, ends, native=self.native)) * grouped_mm(x, w3, ends, native=self.native)
        return grouped_mm(hidden, w2, ends, native=self.native)

    def non_finite_parts(self, inputs: tuple, output: torch.Tensor) -> str | None:
        """Which experts' rows of ``output`` (a forward of ``inputs``) are non-finite, for the
        non-finite guard's report ("expert 5"). Under expert parallelism ``ends``, the rows and
        the numbers are still every expert's, so they are the model's.

        Told by the rows rather than the weights: an expert whose finite weights overflow (fp16)
        shows too, and the guard's replay has no gradients. A mixture of experts named without
        its experts had every expert's rows finite: the routing weights or their sum went
        non-finite."""
        ends = inputs[1]
        if int(ends[-1]) != output.shape[0]:  # not rows grouped as ends says: nothing to tell apart
            return None
        rows = (~torch.isfinite(output.reshape(output.shape[0], -1)).all(1)).nonzero().flatten()
        experts = torch.searchsorted(ends, rows.to(ends.dtype), right=True).unique().tolist()
        if not experts:
            return None
        if len(experts) == 1:
            return f"expert {experts[0]}"
        if len(experts) == ends.numel():
            return f"all {len(experts)} experts"
        listed = ", ".join(map(str, experts[:8])) + (", ..." if len(experts) > 8 else "")
        return f"{len(experts)} experts: {listed}"


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight split over ranks (a DTensor's local tensor), or the weight."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class MoE(nn.Module):
    expert_bias: torch.Tensor
    expert_load: torch.Tensor
    dropped: torch.Tensor
    entropy: torch.Tensor
    # The router's bias and the load statistics start at zero (a model built on meta is told so).
    zeroed = ("expert_bias", "expert_load", "dropped", "entropy")

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        experts_per_token: int,
        d_expert: int,
        shared: nn.Module | None,
        *,
        router: str = "softmax",
        capacity: float = 0.0,
        aux_loss: float = 0.0,
        bias_rate: float = 0.0,
    ):
        """``shared``: the shared experts, as one MLP every token goes through (or None); the rest
        as the GPT's config names them (``router``, ``expert_capacity``, ``router_aux_loss``,
        ``router_bias_rate``)."""
        super().__init__()
        self.n_experts, self.k = n_experts, experts_per_token
        self.sigmoid, self.capacity = router == "sigmoid", capacity
        self.aux_loss, self.bias_rate = aux_loss, bias_rate
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, d_expert)
        self.shared = shared
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        # Counts since the training loop last read them: not part of the model's state.
        self.register_buffer("expert_load", torch.zeros(n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("entropy", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor, losses: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``x`` [B, T, d_model]; the balance loss (scaled) is appended to ``losses`` when given
        and ``router_aux_loss`` is set."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens).float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        chosen = torch.topk(scores + self.expert_bias, self.k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, chosen)
        if self.k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        pairs = chosen.flatten()  # (token, slot) pairs, token-major
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, pairs, torch.ones_like(pairs)
        )
        probs = scores / scores.sum(-1, keepdim=True)  # each token's scores as a distribution
        if self.training:  # evaluation and generation leave the counts to training
            with torch.no_grad():
                self.expert_load += counts.float()
                self.entropy += torch.special.entr(probs).sum()
        # Within an expert, in token order: the keys are unique, so any sort gives this order
        # (ONNX has no stable sort).
        order = (pairs * pairs.numel() + torch.arange(pairs.numel(), device=x.device)).argsort()
        ends = counts.cumsum(0)
        weights = weights.flatten()[order]
        if self.capacity:
            capacity = math.ceil(self.capacity * pairs.numel() / self.n_experts)
            rank = torch.arange(pairs.numel(), device=x.device) - (ends - counts)[pairs[order]]
            kept = rank < capacity
            weights = weights * kept
            if self.training:
                with torch.no_grad():
                    self.dropped += (~kept).sum()
        out = self.experts(tokens[order // self.k], ends.to(torch.int32)) * weights.unsqueeze(-1).to(x.dtype)
        # Back in (token, slot) order, each token's k results summed: no atomics, so deterministic.
        y = torch.empty_like(out).index_copy_(0, order, out).view(-1, self.k, shape[-1]).sum(1)
        if self.shared is not None:
            y = y + self.shared(tokens)
        if losses is not None and self.aux_loss:
            share = counts.float() / pairs.numel()
            losses.append(self.aux_loss * self.n_experts * (share * probs.mean(0)).sum())
        return y.view(shape)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's balancing step from ``load`` (each expert's routed pairs this step, over
        every data-parallel rank): the bias rises by ``router_bias_rate`` for experts below the
        mean load and falls for those above it."""
        if self.bias_rate:
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
