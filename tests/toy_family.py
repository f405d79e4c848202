"""A second model family, deliberately unlike kiln's GPT, that plugs in through the family
interface alone: a causal MLP-mixer language model. Each block mixes tokens with a learned
lower-triangular [T, T] matrix (no attention, no RoPE, no KV cache), then channels with a GELU
MLP whose two projections are its tensor-parallel plan. Its loss is a plain cross-entropy over
logits. Used as ``model.family = "toy_family:FAMILY"`` (tests/ on the Python path);
``toy_family:MINIMAL`` is the same model as a plug-in that keeps every default it can.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ConfigError
from kiln.models.family import HeadMemory, MemoryContext, MemoryModel, ModelFamily, ParallelPlan


@dataclass
class MixerArgs:
    vocab_size: int
    n_layer: int
    d_model: int
    d_ff: int
    seq_len: int


class TokenMix(nn.Module):
    """Each position is a learned mix of itself and the positions before it, per channel."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_len, seq_len))
        self.register_buffer("causal", torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        T = x.size(1)  # noqa: N806
        mix = self.weight[:T, :T].masked_fill(~self.causal[:T, :T], 0.0)
        return mix @ x


class ChannelMLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MixerBlock(nn.Module):
    def __init__(self, a: MixerArgs):
        super().__init__()
        self.token_norm = nn.LayerNorm(a.d_model)
        self.tokens = TokenMix(a.seq_len)
        self.channel_norm = nn.LayerNorm(a.d_model)
        self.channel = ChannelMLP(a.d_model, a.d_ff)

    def forward(self, x):
        x = x + self.tokens(self.token_norm(x))
        return x + self.channel(self.channel_norm(x))


class MixerLM(nn.Module):
    def __init__(self, a: MixerArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.layers = nn.ModuleList(MixerBlock(a) for _ in range(a.n_layer))
        self.final_norm = nn.LayerNorm(a.d_model)
        self.head = nn.Linear(a.d_model, a.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """After PyTorch's own init: the causal masks (buffers) and small output projections."""
        for layer in self.layers:
            layer.tokens.causal.copy_(torch.ones_like(layer.tokens.causal).tril())
            nn.init.normal_(layer.channel.down.weight, std=0.02 / math.sqrt(2 * self.args.n_layer))

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.final_norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class MixerMemory(MemoryModel):
    """What autograd keeps, counted for fp32 (the toy is not planned under autocast): per block,
    each LayerNorm's input, its normalised output and the two per-token statistics; the token
    mix's input (a [T, T] product saves both operands; the masked weight is tiny); the MLP's
    input, pre-activation and activation."""

    buffers = "causal masks"
    backward_peak_grad = "channel.up"

    def __init__(self, a: MixerArgs):
        self.a = a
        self.n_layer, self.d_model, self.vocab_size = a.n_layer, a.d_model, a.vocab_size

    def block_activations(self, ctx: MemoryContext) -> int:
        d, ff = self.d_model, self.a.d_ff // ctx.tp
        per_token = ctx.residual_bytes * d + 2 * (4 * d + 8) + 4 * d + 4 * d + 2 * 4 * ff
        return ctx.tokens * per_token

    def block_backward_workspace(self, ctx: MemoryContext) -> int:
        return 4 * ctx.tokens * (2 * self.d_model + self.a.d_ff // ctx.tp)

    def after_blocks(self, ctx: MemoryContext) -> int:
        return ctx.tokens * (4 * self.d_model + 8)

    def head(self, ctx: MemoryContext) -> HeadMemory:
        """Plain logits: the head keeps its (normed) input and the loss its log-softmax, made from
        the [tokens, vocab] logits, which live until it is; its backward holds the log-softmax,
        its gradient and the logits' gradient at once."""
        logits, normed = 4 * ctx.tokens * self.vocab_size, 4 * ctx.tokens * self.d_model
        return HeadMemory(normed + logits, logits, normed + 3 * logits)

    def embedding_backward(self, ctx: MemoryContext, accumulating: bool) -> int:
        return 4 * ctx.tokens * self.d_model + 4 * self.vocab_size * self.d_model * (1 if accumulating else 0)


def _channel_styles(block: nn.Module) -> dict:
    """A mixer block over tensor-parallel ranks: its channel MLP split Megatron-style."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"channel.up": ColwiseParallel(), "channel.down": RowwiseParallel()}


class MixerFamily(ModelFamily):
    name = "mixer"

    def resolve(self, model_cfg, *, vocab_size: int, seq_len: int) -> MixerArgs:
        dims = {
            key: getattr(model_cfg, key) or default for key, default in (("n_layer", 2), ("d_model", 64), ("d_ff", 128))
        }
        bad = [
            f"model.{key}: must be positive (or 0 for the toy's default), got {v}" for key, v in dims.items() if v < 0
        ]
        if bad:
            raise ConfigError(bad)
        return MixerArgs(vocab_size=vocab_size, seq_len=seq_len, **dims)

    def build(self, args: MixerArgs) -> MixerLM:
        return MixerLM(args)

    def args_to_dict(self, args: MixerArgs) -> dict:
        return dataclasses.asdict(args)

    def args_from_dict(self, values) -> MixerArgs:
        return MixerArgs(**values)

    def describe(self, model_cfg, args: MixerArgs, model) -> str:
        return f"mixer: {sum(p.numel() for p in model.parameters()):,} parameters, {args.n_layer} layers"

    def parallel_plan(self, args: MixerArgs) -> ParallelPlan:
        return ParallelPlan(
            blocks="layers",
            tensor_parallel=_channel_styles,
            tp_divisors={"model.d_ff": args.d_ff},
            derived_buffers=True,
        )

    def flops_per_token(self, args: MixerArgs, seq_len: int) -> float:
        """6 FLOPs per matmul weight and token, plus the token mix: about seq_len / 2 inputs per
        output, per channel, forward and backward."""
        matmul = args.n_layer * 2 * args.d_model * args.d_ff + args.vocab_size * args.d_model
        return 6.0 * matmul + 3.0 * args.n_layer * args.d_model * seq_len

    def memory_model(self, args: MixerArgs) -> MixerMemory:
        return MixerMemory(args)


FAMILY = MixerFamily()


class MinimalFamily(ModelFamily):
    """The mixer as a plug-in that overrides only what it must: how to read ``[model]``, build
    the model, save its arguments and count its activations (for ``kiln plan``). Everything else
    is ``ModelFamily``'s default: description, parallel plan, FLOPs, loss and evaluation."""

    def resolve(self, model_cfg, *, vocab_size: int, seq_len: int) -> MixerArgs:
        return MixerArgs(vocab_size=vocab_size, seq_len=seq_len, n_layer=model_cfg.n_layer or 2, d_model=32, d_ff=64)

    def build(self, args: MixerArgs) -> MixerLM:
        return MixerLM(args)

    def args_to_dict(self, args: MixerArgs) -> dict:
        return dataclasses.asdict(args)

    def args_from_dict(self, values) -> MixerArgs:
        return MixerArgs(**values)

    def memory_model(self, args: MixerArgs) -> MixerMemory:
        return MixerMemory(args)


MINIMAL = MinimalFamily()
