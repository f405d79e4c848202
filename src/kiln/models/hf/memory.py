"""What a BERT-style encoder keeps for its backward pass, for ``kiln plan`` (an estimate).

A post-norm layer saves, per token: the input of the q/k/v projections, q, k and v (and the
scaled q), attention's output and log-sum-exp, the input of the attention output projection, two
LayerNorms' inputs and statistics, the MLP's input, pre-activation and GELU output, and the
dropout masks (one byte per element). With attention dropout in training, PyTorch's math kernel
also keeps the [heads, T, T] probabilities twice (before and after dropout) and the mask. The
classifier head (pooler and one projection per sequence) is small beside them. Checked against
measured CPU steps of a 3-layer BERT: within 10% (tests/models/test_hf.py allows 20% for its
2-layer one, where fixed costs weigh more).
"""

from __future__ import annotations

from typing import Any

from kiln.models.family import HeadMemory, MemoryContext, MemoryModel


def ffn_width(config: Any) -> int:
    """The width of a layer's MLP, under the names architectures give it (4 x hidden_size, GPT-2's
    default, where none is set). Of a mixture of experts, the width a token goes through: its
    experts per token times an expert's width (Qwen-MoE's moe_intermediate_size; Mixtral's experts
    are intermediate_size wide)."""
    k = getattr(config, "num_experts_per_tok", None)
    if k and getattr(config, "num_experts", None):
        return k * (getattr(config, "moe_intermediate_size", None) or _dense_width(config))
    return _dense_width(config)


def _dense_width(config: Any) -> int:
    for name in ("intermediate_size", "n_inner", "ffn_dim", "hidden_dim"):
        if width := getattr(config, name, None):
            return int(width)
    return 4 * config.hidden_size


class EncoderMemory(MemoryModel):
    buffers = "position ids"
    backward_peak_grad = None

    def __init__(self, config: Any, num_labels: int):
        """``config``: the ``transformers`` config object, whose attribute_map reads every
        architecture's names as BERT's (DistilBERT's ``dim`` as ``hidden_size``, ...)."""
        self.c = config
        self.n_layer, self.d_model, self.vocab_size = config.num_hidden_layers, config.hidden_size, config.vocab_size
        self.heads = getattr(config, "num_attention_heads", None) or 1  # FNet has none: counted as one
        self.d_ff = ffn_width(config)
        # BERT's name for attention's dropout, or DistilBERT's and ModernBERT's.
        dropout = getattr(config, "attention_probs_dropout_prob", None)
        self.attention_dropout = (dropout if dropout is not None else getattr(config, "attention_dropout", 0.0)) > 0
        self.num_labels = num_labels

    def block_activations(self, ctx: MemoryContext) -> int:
        d, ff, heads, act = self.d_model, self.d_ff // ctx.tp, self.heads // ctx.tp, ctx.act_bytes
        per_token = act * 7 * d + 4 * heads + 2 * d + 2 * (4 * d + 8) + 2 * act * ff + ff
        if self.attention_dropout:
            # A query's probabilities over every key of its sequence, before and after dropout, and the mask.
            per_token += heads * (2 * act + 1) * ctx.seq_len
        return ctx.tokens * per_token

    def block_backward_workspace(self, ctx: MemoryContext) -> int:
        return 4 * ctx.tokens * self.d_model + 2 * ctx.act_bytes * ctx.tokens * (self.d_ff // ctx.tp)

    def before_blocks(self, ctx: MemoryContext) -> int:
        """The embeddings' LayerNorm (its input and statistics) and dropout mask."""
        return ctx.tokens * (4 * self.d_model + 8 + self.d_model)

    def head(self, ctx: MemoryContext) -> HeadMemory:
        return HeadMemory(0, 0, 0)

    def embedding_backward(self, ctx: MemoryContext, accumulating: bool) -> int:
        return 4 * ctx.tokens * self.d_model + 4 * self.vocab_size * self.d_model
