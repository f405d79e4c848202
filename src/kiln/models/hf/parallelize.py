"""How a Hugging Face Llama-class decoder (Llama, Mistral, Qwen2, Qwen3) splits over
tensor-parallel ranks, as PyTorch's ``ParallelStyle`` objects: Megatron's layout under the
projection names these architectures share. The attention's and MLP's input projections split
column-wise (a rank owns whole heads and a slice of the hidden units), their output projections
row-wise (one all-reduce each); norms, embedding and output layer whole on every rank."""

from __future__ import annotations

from typing import Any

from torch import nn

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def llama_styles(layer: nn.Module) -> dict[str, Any]:
    """The styles of one decoder layer's modules, by their name in the layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{name: ColwiseParallel() for name in COLWISE}, **{name: RowwiseParallel() for name in ROWWISE}}
