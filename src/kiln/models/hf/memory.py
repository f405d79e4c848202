"""What a BERT-style encoder keeps for its backward pass, for ``kiln plan`` (an estimate).

A post-norm layer saves, per token: the input of the q/k/v projections, q, k and v, attention's
output and log-sum-exp, the input of the attention output projection, two LayerNorms' inputs and
statistics, the MLP's input, pre-activation and GELU output, and the dropout masks (one byte per
element). With attention dropout in training, PyTorch's math kernel also keeps the [heads, T, T]
probabilities and their mask. The classifier head (pooler and one projection per sequence) is
small beside them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.models.family import HeadMemory, MemoryContext, MemoryModel


class EncoderMemory(MemoryModel):
    buffers = "position ids"
    backward_peak_grad = None

    def __init__(self, config: Mapping[str, Any], num_labels: int):
        self.c = config
        self.n_layer, self.d_model, self.vocab_size = (
            config["num_hidden_layers"],
            config["hidden_size"],
            config["vocab_size"],
        )
        self.heads = config["num_attention_heads"]
        self.d_ff = config["intermediate_size"]
        self.seq = config.get("max_position_embeddings", 512)
        self.attention_dropout = config.get("attention_probs_dropout_prob", 0.0) > 0
        self.num_labels = num_labels

    def block_activations(self, ctx: MemoryContext) -> int:
        d, ff, heads, act = self.d_model, self.d_ff // ctx.tp, self.heads // ctx.tp, ctx.act_bytes
        per_token = act * 6 * d + 4 * heads + 2 * d + 2 * (4 * d + 8) + 2 * act * ff + ff
        if self.attention_dropout:
            # The probabilities of a query over every key of its sequence, and their dropout mask.
            per_token += heads * (act + 1) * self.seq
        return ctx.tokens * per_token

    def block_backward_workspace(self, ctx: MemoryContext) -> int:
        return 4 * ctx.tokens * self.d_model + 2 * ctx.act_bytes * ctx.tokens * (self.d_ff // ctx.tp)

    def head(self, ctx: MemoryContext) -> HeadMemory:
        return HeadMemory(0, 0, 0)

    def embedding_backward(self, ctx: MemoryContext, accumulating: bool) -> int:
        return 4 * ctx.tokens * self.d_model + 4 * self.vocab_size * self.d_model
