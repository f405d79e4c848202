"""Context parallelism: each sequence split over the "cp" ranks of the world's mesh, which hold
the same batch and share its sequences' attention.

A sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); rank r holds chunk r and chunk
2 cp - 1 - r. Under causal attention a chunk's cost grows with its place in the sequence, so the
pair costs every rank the same (the load balancing of Megatron's and PyTorch's context
parallelism). Two places of the model take part, named by its family's plan:

- the model itself: hooks around its forward give it this rank's chunks of the batch's tokens
  and targets at their own positions (``positions=``), and turn what it returns into the whole
  sequences' mean loss, the same on every rank of the group (or, without targets, the whole
  sequences' logits);
- each block's attention core (a module without parameters) is replaced by one that gathers the
  keys and values of every rank of the group (one all-gather per layer, whose backward
  reduce-scatters their gradients) and runs each of its two chunks' queries over the keys up to
  the chunk's end, causally aligned at the end (the all-gather variant of ring attention, as
  Llama 3 trained long context: with grouped-query attention the keys and values are the
  smaller half of the traffic).

Rows that pack documents (positions per row that restart at each, ``data.document_mask`` or
packed records) keep each document's attention to itself across the chunks: the core gathers
the group's positions too. A Hugging Face Llama-class model takes part the same way, its
attention function plugged in through ``transformers.AttentionInterface``
(``apply_cp_transformers``) and the hooks cutting its wrapper's inputs, labels and positions.

Decoding (a kv cache) runs the plain forward on every rank: generation is not split.

Gradients: the group's loss is the sum over its ranks of each one's share, made by an all-reduce
whose backward scales the (equal) incoming gradient by cp instead of communicating; data-parallel
training then averages each rank's gradients over all data-parallel ranks, cp included, which
gives the gradient of the sequence's loss.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.labels import IGNORE_INDEX
from kiln.models.lm import document_ids, document_mask


def local_positions(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of a sequence of ``length`` tokens that context-parallel rank ``rank`` of
    ``cp`` holds: its head chunk, then its tail chunk."""
    if length % (2 * cp):
        raise ValueError(
            f"a sequence of {length} tokens does not cut into 2 x parallel.cp = {2 * cp} equal chunks "
            "(2 x parallel.cp must divide data.seq_len)"
        )
    chunk = length // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat((head, head.new_tensor(range(length - (rank + 1) * chunk, length - rank * chunk))))


def _renamed(module: Any, name: str, old: str) -> Any:
    """``module.name``, or ``module.old`` where this PyTorch predates the name (2.13 renamed the
    single-tensor collectives and deprecates the old names)."""
    return getattr(module, name, None) or getattr(module, old)


class _GatherSequence(torch.autograd.Function):
    """The chunks of every rank of ``group`` stacked on dim 0, forward; backward, the gradient of
    this rank's chunk summed over the ranks that used it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _renamed(dist, "all_gather_single", "all_gather_into_tensor")(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        out = grad.new_empty((grad.size(0) // ctx.size, *grad.shape[1:]))
        _renamed(dist, "reduce_scatter_single", "reduce_scatter_tensor")(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _SumOverGroup(torch.autograd.Function):
    """The sum of ``x`` over the ranks of ``group``, forward; backward, the incoming gradient,
    which is the same on every rank (each computes the same loss from the sum), times the
    group's size: data-parallel training averages it back over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.size = size
        x = x.detach().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.size, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Any, cp: int) -> torch.Tensor:
    """The whole sequences of ``x``, each rank of ``group`` holding its chunks along ``dim``, in
    their order in the sequence (differentiable)."""
    moved = x.movedim(dim, 0)
    stacked = _GatherSequence.apply(moved, group, cp)
    length = stacked.size(0)
    held = torch.cat([local_positions(length, cp, r, x.device) for r in range(cp)])
    return stacked[held.argsort()].movedim(0, dim)


class ContextParallelAttend(nn.Module):
    """An attention core (``inner``) whose queries are this rank's two chunks of each sequence,
    over the keys and values of the whole sequence, gathered from the group."""

    def __init__(self, inner: nn.Module, group: Any, cp: int, rank: int):
        super().__init__()
        self.inner, self.group, self.cp, self.rank = inner, group, cp, rank

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = True,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if mask is not None or not causal:  # decoding over a kv cache: not split
            return self.inner(q, k, v, mask, causal)
        from torch.nn.attention.bias import causal_lower_right

        # Packed documents: which one each token of the whole sequences is in, from every rank's
        # positions in them (a small all-gather of integers per layer).
        ids = None if documents is None else document_ids(gather_sequence(documents, 1, self.group, self.cp))
        keys = gather_sequence(k, 2, self.group, self.cp)
        values = gather_sequence(v, 2, self.group, self.cp)
        if (group := q.size(1) // k.size(1)) > 1:
            # Repeated for the query heads here, once: the head chunk's keys are a prefix of the
            # tail chunk's, so the two calls share (and autograd saves) one copy.
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        length, chunk = keys.size(2), q.size(2) // 2
        outs = []
        for part, end in ((0, (self.rank + 1) * chunk), (1, length - self.rank * chunk)):
            # Query i of a chunk ending at ``end`` sees keys 0..end - chunk + i: a causal mask
            # aligned to the lower right corner, which flash kernels run without a mask tensor.
            queries = q[:, :, part * chunk : (part + 1) * chunk]
            bias: Any
            if ids is None:
                bias = causal_lower_right(chunk, end)
            else:  # the same triangle, within each document
                bias = document_mask(
                    ids[:, end - chunk : end], ids[:, :end], torch.arange(end - chunk, end, device=q.device)
                )
            outs.append(self.inner(queries, keys[:, :, :end], values[:, :, :end], bias, False))
        return torch.cat(outs, dim=2)


@dataclass(frozen=True)
class Inputs:
    """The arguments of a model's forward that the split cuts, by name: the tokens, the targets
    (the next token of each), the positions; ``cache``: a KV cache, given when decoding (then
    every rank runs the whole sequence); ``labels``: targets aligned with the tokens (shifted
    inside the model; the split shifts them first); ``padding``: a padding mask, left out (rows
    are padded on the right, which no earlier position sees); ``row_positions``: the model takes
    positions per row [B, T] (transformers'), not one row [T] for all."""

    tokens: str
    targets: str
    positions: str
    cache: str | None = None
    labels: str | None = None
    padding: str | None = None
    row_positions: bool = False


GPT_INPUTS = Inputs("idx", "targets", "positions", cache="kv_cache")
TRANSFORMERS_INPUTS = Inputs(
    "input_ids",
    "targets",
    "position_ids",
    labels="labels",
    padding="attention_mask",
    row_positions=True,
    cache="decoding",  # kiln's wrapper's keywords for the decoder (its cache)
)


class SequenceSplit:
    """This rank's part of the sequences of the cp ranks of ``group``: installed around a model's
    forward (``install``), or around each pipeline stage's, which it gives this rank's chunks of
    the batch and whose result it makes the whole sequences'. ``packed``: the last forward's rows
    pack documents (the caller gave their positions)."""

    def __init__(self, group: Any, cp: int, rank: int, names: Inputs):
        self.group, self.cp, self.rank, self.names = group, cp, rank, names
        self.packed = False

    def install(self, module: nn.Module, *, first: bool = True, last: bool = True) -> None:
        """Hooks around ``module``'s forward: a whole model's, or a pipeline stage's, whose input
        is this rank's chunks already unless it is the ``first`` stage (the tokens), and whose
        output is hidden states to pass on unless it is the ``last``."""
        hooks = _SplitHooks(self, inspect.signature(module.forward), first, last)
        module.register_forward_pre_hook(hooks.before, with_kwargs=True)
        module.register_forward_hook(hooks.after, with_kwargs=True)


class _SplitHooks:
    """The hooks ``SequenceSplit.install`` puts around one module's forward (one forward's
    targets kept from the first for the second; activation checkpointing does not recompute the
    model's own forward)."""

    def __init__(self, split: SequenceSplit, signature: inspect.Signature, first: bool, last: bool):
        self.split, self.signature, self.first, self.last = split, signature, first, last
        self.pending: list[tuple[torch.Tensor | None, torch.Tensor, int | None] | None] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        split = self.split
        bound = self.signature.bind(*args, **kwargs)
        given, n, cp = bound.arguments, split.names, split.cp
        if n.cache and given.get(n.cache) is not None:  # decoding: every rank runs the whole sequence
            self.pending.append(None)
            return args, kwargs
        idx, targets, positions = given[n.tokens], given.get(n.targets), given.get(n.positions)
        shifted = False
        if n.labels and (labels := given.pop(n.labels, None)) is not None:
            targets, shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX), True
        if n.padding:
            given.pop(n.padding, None)
        split.packed = positions is not None and positions.dim() == 2
        # The sequences' length: the tokens' in the first stage; past it, the inputs are hidden
        # states of this rank's chunks, and the targets or positions every stage takes tell it.
        whole_rows = idx if self.first else targets if targets is not None else positions if split.packed else None
        width = idx.size(1) * cp if whole_rows is None else whole_rows.size(1)
        # What comes back whole, of how many positions: logits, or each target's log-probability
        # (token_logps; one position fewer when the targets came as labels); else a mean loss.
        whole = width if targets is None else (width - shifted if given.get("token_logps") else None)
        if pad := -width % (2 * cp):
            # Rows of any length (a benchmark task's, a padded batch's) padded on the right to
            # whole chunks, which no earlier position sees under causal attention, and cut back.
            idx = F.pad(idx, (0, pad)) if self.first else idx
            targets = None if targets is None else F.pad(targets, (0, pad), value=IGNORE_INDEX)
            positions = None if positions is None else F.pad(positions, (0, pad))
        held = local_positions(width + pad, cp, split.rank, idx.device)
        # Positions per row (packed documents) are cut as the tokens are; else they are the held ones.
        if positions is not None:
            given[n.positions] = positions[:, held]
        else:
            given[n.positions] = held.expand(len(idx), -1) if n.row_positions else held
        given[n.tokens] = idx[:, held] if self.first else idx
        if targets is not None:
            given[n.targets] = targets[:, held]
        self.pending.append((targets, held, whole))
        return bound.args, bound.kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        pending = self.pending.pop()
        if pending is None or not self.last:  # decoding, or hidden states for the next stage
            return out
        targets, held, whole = pending
        split = self.split
        if whole is not None:
            # Whole on every rank (the backward of the gather sums every rank's gradient of its
            # chunk: cp times one loss's, which data-parallel averaging over the group divides).
            return gather_sequence(out, 1, split.group, split.cp)[:, :whole]
        assert targets is not None  # a mean loss is returned given targets
        # This rank's share of the sequences' mean loss: its mean over its counted tokens, weighed
        # by its part of them (a chunk can hold fewer, e.g. past a completion's end).
        share = (targets[:, held] != IGNORE_INDEX).sum() / (targets != IGNORE_INDEX).sum().clamp(min=1)
        return _SumOverGroup.apply(out * share, split.group, split.cp)


def apply_cp(blocks: list[nn.Module], core: str, cp_mesh: Any) -> SequenceSplit:
    """Make a model split its sequences over ``cp_mesh`` (the 1-D mesh of this rank's "cp"
    ranks): each of its ``blocks`` gets a context-parallel attention core in place of its
    ``core`` (a path in the block), in place; the split of its inputs is returned, to install
    around the model's forward (or each of its pipeline stages')."""
    group, size, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    owner, _, leaf = core.rpartition(".")
    for block in blocks:
        parent = block.get_submodule(owner)
        setattr(parent, leaf, ContextParallelAttend(getattr(parent, leaf), group, size, rank))
    return SequenceSplit(group, size, rank, GPT_INPUTS)


class _ScaledAttend(nn.Module):
    """SDPA at a model's own scale (``transformers`` passes it: Gemma's is not 1 / sqrt(head_dim))."""

    def __init__(self, scale: float | None):
        super().__init__()
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = True
    ) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)


def apply_cp_transformers(hf: nn.Module, cp_mesh: Any) -> SequenceSplit:
    """Make kiln's wrapper of the ``transformers`` causal LM ``hf`` split its sequences over
    ``cp_mesh``: ``hf`` computes attention with a function registered for it
    (``transformers.AttentionInterface``, its public way to plug one in) that gathers the group's
    keys and values as ``ContextParallelAttend`` does; the split of the wrapper's inputs is
    returned, to install as ``apply_cp``'s. Decoding with a KV cache (``use_cache``) runs
    transformers' SDPA on the whole sequence."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kiln.config import ConfigError

    c = cast(Any, hf).config
    layers = set(getattr(c, "layer_types", None) or ())
    windowed = bool(getattr(c, "sliding_window", None)) and getattr(c, "use_sliding_window", True)
    if getattr(c, "attn_logit_softcapping", None) or "sliding_attention" in layers or windowed:
        raise ConfigError(
            [
                f"parallel.cp: {type(hf).__name__}'s attention (a sliding window or capped logits) is not split "
                "over context-parallel ranks; set parallel.cp=1"
            ]
        )
    group, size, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    split = SequenceSplit(group, size, rank, TRANSFORMERS_INPUTS)
    cores: dict[float | None, ContextParallelAttend] = {}  # by the scale each layer passes

    def attend(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("use_cache") is not False:  # decoding (or a call outside kiln's wrapper): whole
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        documents = kwargs.get("position_ids") if split.packed else None
        if scaling not in cores:
            cores[scaling] = ContextParallelAttend(_ScaledAttend(scaling), group, size, rank)
        return cores[scaling](query, key, value, None, True, documents).transpose(1, 2).contiguous(), None

    name = f"kiln_context_parallel_{id(hf)}"
    AttentionInterface.register(name, attend)
    cast(Any, hf).set_attn_implementation(name)
    if c._attn_implementation != name:
        raise ConfigError([f"parallel.cp: {type(hf).__name__} does not take a plugged-in attention; set parallel.cp=1"])
    return split
