"""A decoder-only Transformer in the Llama style.

Pre-norm RMSNorm blocks, rotary position embeddings, grouped-query attention through
``F.scaled_dot_product_attention`` (so flash kernels run on GPU) and a SwiGLU MLP; no biases.
With ``n_experts``, the blocks from ``moe_layer_start`` on have a mixture of experts in place of
the MLP (``moe.py``).
Given targets, the model returns the mean next-token loss instead of logits, computed in fp32 by
a fused projection + cross-entropy that never holds the full [tokens, vocab] logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.fused_loss import LinearCrossEntropy
from kiln.models.gpt.moe import MoE
from kiln.models.init import Initial
from kiln.models.lm import document_ids, document_mask


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    max_seq_len: int
    tie_embeddings: bool
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm over each head's queries and keys (Qwen3's q_norm, k_norm)
    mlp: str = "swiglu"  # the dense blocks' MLP: swiglu or relu2 (see MLP)
    zero_init: bool = False  # the output layer and the residual projections start at zero
    logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0: off
    init_std: float = 0.02
    # Mixture of experts (moe.py); n_experts 0: every block dense.
    n_experts: int = 0
    experts_per_token: int = 0
    n_shared_experts: int = 0
    d_expert: int = 0
    moe_layer_start: int = 0
    router: str = "softmax"
    router_bias_rate: float = 0.0
    router_aux_loss: float = 0.0
    expert_capacity: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture of experts in place of its MLP."""
        return self.n_experts > 0 and layer >= self.moe_layer_start


def rope_tables(head_dim: int, end: int, theta: float, device=None, start: int = 0, positions=None):
    """cos and sin of every (position, frequency) pair for positions start..end - 1, each
    [end - start, head_dim // 2], fp32; or for ``positions`` [B, T]: [B, 1, T, head_dim // 2] (each
    row's, for every head), the same values as those of the tables at those positions."""
    if positions is not None:
        device = positions.device
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if positions is not None:
        angles = (positions[..., None].float() * freqs).unsqueeze(1)
    else:
        angles = torch.outer(torch.arange(start, end, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + head_dim/2]) of x [B, H, T, head_dim] by their position's angles."""
    x1, x2 = x.chunk(2, dim=-1)
    # Multiplying by the fp32 tables promotes bf16 activations, so the rotation itself is done in
    # fp32: in bf16, nearby positions' angles would round to the same value at long context.
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    residual = ("wo",)  # what writes into the residual stream (its init is scaled down: GPT.init_tensor)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        if cfg.qk_norm:  # one gain per head dimension, shared by the heads
            self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.core = Attend()

    def forward(self, x, rope_cos, rope_sin, cache=None, documents=None):
        B, T, _ = x.shape  # noqa: N806
        # Head counts are inferred (-1): under tensor parallelism a rank holds only some heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        # The tables may run past these positions (see GPT.forward): their first T are these.
        rope_cos, rope_sin = rope_cos[..., :T, :], rope_sin[..., :T, :]
        q, k = apply_rope(q, rope_cos, rope_sin), apply_rope(k, rope_cos, rope_sin)

        mask, causal = None, True
        if cache is not None:  # decoding: this layer of a kiln.models.decode.SlotCache
            k, v, mask = cache.attend(k, v)
            causal = False
        y = self.core(q, k, v, mask, causal, documents)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Attend(nn.Module):
    """Attention of queries q [B, H, T, head_dim] over keys and values [B, H_kv, S, head_dim]:
    causal (query i sees keys 0..i), or as ``mask`` says (a boolean mask or an attention bias);
    given ``documents`` (each token's position in its document [B, T]), causal within each
    document only. A module of its own, without parameters, so that a layout can put another in
    its place (context parallelism's sees the keys of the sequence's other chunks)."""

    def forward(self, q, k, v, mask=None, causal=True, documents=None):
        k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
        if documents is not None:
            ids = document_ids(documents)
            mask = document_mask(ids, ids, torch.arange(ids.size(1), device=ids.device))
            causal = False
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values [B, H_kv, S, head_dim] for ``heads`` query heads: each group of
    heads // H_kv query heads shares one key/value head."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


MLPS = ("swiglu", "relu2")


class MLP(nn.Module):
    """SwiGLU, a SiLU-gated linear unit, w2(silu(w1 x) * w3 x); or ``kind="relu2"``, the squared
    ReLU of the GPT-2 speedruns (Primer, So et al. 2021), w2(relu(w1 x)^2), with no w3."""

    residual = ("w2",)

    def __init__(self, d_model: int, d_ff: int, kind: str = "swiglu"):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if kind == "swiglu" else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x, losses=None):
        if self.w3 is None:
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe(cfg: GPTConfig) -> MoE:
    """The mixture of experts of a block of ``cfg``'s model."""
    shared = MLP(cfg.d_model, cfg.n_shared_experts * cfg.d_expert) if cfg.n_shared_experts else None
    return MoE(
        cfg.d_model,
        cfg.n_experts,
        cfg.experts_per_token,
        cfg.d_expert,
        shared,
        router=cfg.router,
        capacity=cfg.expert_capacity,
        aux_loss=cfg.router_aux_loss,
        bias_rate=cfg.router_bias_rate,
    )


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.layer = layer  # its place in the whole model: a pipeline stage's blocks keep theirs
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = moe(cfg) if cfg.is_moe(layer) else MLP(cfg.d_model, cfg.d_ff, cfg.mlp)

    def forward(self, x, rope_cos, rope_sin, cache=None, losses=None, documents=None):
        """``losses``: where a mixture of experts appends its balance loss, when it has one;
        ``documents``: each token's position in its document, where rows pack documents."""
        x = x + self.attn(self.attn_norm(x), rope_cos, rope_sin, cache, documents)
        return x + self.mlp(self.mlp_norm(x), losses)


class _ContiguousGradient(torch.autograd.Function):
    """The identity; backward, the gradient in contiguous memory. A pipeline stage sends the
    gradient of the hidden states it was given back to the stage before, which receives it into a
    contiguous buffer; a sequence-parallel norm's gradient is a strided view."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GPT(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head_loss = LinearCrossEntropy(config.logit_softcap)
        # Derived from the config, so kept out of the state_dict; init_weights fills them.
        half = config.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, half), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """(Re)initialise every parameter and buffer in place, e.g. after ``to_empty`` from meta:
        each tensor from a generator seeded by ``seed`` and its name (``kiln.models.init``), so a
        rank can initialise a shard of it alone; no ``seed`` (a model constructed directly):
        from PyTorch's global generator, tensor after tensor. A model on ``meta`` is only tied;
        one built with its parameters on ``meta`` and real buffers (``params_on_meta``) gets its
        buffers' values, as a constructor computes them."""
        if self.config.tie_embeddings:
            # Done here rather than in __init__ because to_empty() replaces the tensors of a
            # meta-device model one module at a time, which unties them.
            self.lm_head.weight = self.tok_emb.weight
        if self.tok_emb.weight.is_meta:
            for name, buffer in self.named_buffers():
                if not buffer.is_meta:
                    buffer.copy_(self.init_tensor(name, buffer.shape, None))
            return
        Initial(self, seed).fill(self)

    def init_tensor(self, name: str, shape: torch.Size, generator: torch.Generator | None) -> torch.Tensor:
        """The whole initial value of the parameter or buffer ``name``, drawn from ``generator``:
        normal(0, init_std) for linear and embedding weights, with the projections back into the
        residual stream scaled down (2 * n_layer branches add into it, so shrinking each keeps its
        variance at init independent of depth; zero with ``zero_init``, as the output layer), ones
        for the norms, the rotary tables computed."""
        cfg = self.config
        if name in ("rope_cos", "rope_sin"):
            return rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)[name == "rope_sin"]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        # Each module says which of its tensors start at zero and which write into the residual
        # stream (``zeroed``, ``residual``: a tensor's name, or its linear layer's).
        *path, local = name.split(".")
        owner, parent = self.get_submodule(".".join(path)), self.get_submodule(".".join(path[:-1]))
        if local in getattr(owner, "zeroed", ()):
            return torch.zeros(shape)
        residual = local in getattr(owner, "residual", ()) or (
            local == "weight" and bool(path) and path[-1] in getattr(parent, "residual", ())
        )
        if cfg.zero_init and (residual or name == "lm_head.weight"):
            return torch.zeros(shape)
        std = cfg.init_std / math.sqrt(2 * cfg.n_layer) if residual else cfg.init_std
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (a tied matrix counts once); optionally without the input embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if exclude_embedding else n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: Any = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ):
        """Logits [B, T, V] for tokens idx [B, T] at positions start_pos..start_pos + T - 1 (those
        of the last ``logits_to_keep`` positions, when not 0, as transformers' models take it),
        or, given targets [B, T] (-100 where no loss is wanted), their mean cross-entropy.

        With a ``kv_cache`` (a bound ``kiln.models.decode.SlotCache``) each row is at the positions
        the cache was bound with: the keys and values of these tokens are written into it and
        they attend to their row's cached tokens before them as well.

        ``positions`` [T] (without a kv_cache): the tokens' positions, where they are not
        0..T - 1, e.g. a context-parallel rank's chunks of a longer sequence; attention is causal
        in the order of ``idx`` whatever they are (each attention's ``core`` decides what each sees).
        ``positions`` [B, T]: each row packs documents, each token at its position in its own
        document (0 where one starts, as ``transformers``' position_ids of packed rows), and
        attention stays within each document.

        A pipeline stage is this model with some modules removed (None): without ``tok_emb`` it
        takes hidden states [B, T, d_model] instead of tokens, without ``norm`` and ``lm_head``
        it returns them.
        """
        T = idx.size(1)  # noqa: N806
        end = start_pos + T
        cfg = self.config
        documents = positions if positions is not None and positions.dim() == 2 else None
        if kv_cache is not None:  # computed, not looked up: past max_seq_len the cache is a ring
            rope_cos, rope_sin = rope_tables(cfg.head_dim, 0, cfg.rope_theta, positions=kv_cache.positions)
        elif positions is not None:
            rope_cos, rope_sin = self.rope_cos[positions], self.rope_sin[positions]
            if documents is not None:  # [B, 1, T, head_dim / 2]: each row's, for every head
                rope_cos, rope_sin = rope_cos.unsqueeze(1), rope_sin.unsqueeze(1)
        elif end <= cfg.max_seq_len:
            # From start_pos on: a pipeline stage given hidden states split by position (sequence
            # parallelism) holds a tp-th of the positions its attention gathers and rotates.
            rope_cos, rope_sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]
        else:
            raise ValueError(f"positions up to {end} exceed max_seq_len {cfg.max_seq_len}")
        x = _ContiguousGradient.apply(idx) if self.tok_emb is None else self.tok_emb(idx)
        losses: list[torch.Tensor] = []  # the mixtures of experts' balance losses, when they have them
        for block in self.blocks.children():  # a pipeline stage's: some, in order
            cache = None if kv_cache is None else kv_cache.layer(block.layer)
            x = block(x, rope_cos, rope_sin, cache, losses, documents)
        if self.norm is None:
            # Sent to the next pipeline stage, which sends its gradient back into a buffer of the
            # same strides: a rank's positions of a sequence-parallel output are a strided view.
            return x.contiguous()
        x = self.norm(x)
        cap = self.config.logit_softcap
        if targets is None:
            logits = self.lm_head(x[:, -logits_to_keep:])
            return cap * torch.tanh(logits / cap) if cap else logits
        loss = self.head_loss(x, self.lm_head.weight, targets)
        return loss + sum(losses) if losses else loss
