"""How a Hugging Face Llama-class decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) splits over
tensor-parallel ranks, as PyTorch's ``ParallelStyle`` objects: Megatron's layout under the
projection names these architectures share. The attention's and MLP's input projections split
column-wise (a rank owns whole heads and a slice of the hidden units), their output projections
row-wise (one all-reduce each); norms (Gemma 3's per-head query and key norms too: a rank's
heads are whole), embedding and output layer whole on every rank. Phi-3's fused projections
(qkv_proj, gate_up_proj) would need each part split on its own: it has no plan yet."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
# Where the per-head query and key norms of a model type find the heads in their input: Qwen3
# norms [B, T, heads, head_dim], Gemma 3 after moving the heads first, [B, heads, T, head_dim].
QK_NORM_HEADS = {"qwen3": 2, "gemma3_text": 1}


def llama_styles(layer: nn.Module, qk_norm_heads: int | None = None) -> dict[str, Any]:
    """The styles of one decoder layer's modules, by their name in the layer. With per-head query
    and key norms (their heads at dim ``qk_norm_heads`` of the input), each rank norms its own
    heads with gains replicated over the ranks, whose gradients (a sum over each rank's heads)
    are summed across them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles: dict[str, Any] = {
        **{name: ColwiseParallel() for name in COLWISE},
        **{name: RowwiseParallel() for name in ROWWISE},
    }
    attn = layer.get_submodule("self_attn")
    norms = [f"self_attn.{name}" for name in ("q_norm", "k_norm") if hasattr(attn, name)]
    if norms and qk_norm_heads is None:
        raise ValueError(f"{type(layer).__name__} norms its query and key heads at a place kiln does not know")
    for name in norms:
        styles[name] = SequenceParallel(sequence_dim=cast(int, qk_norm_heads), use_local_output=True)
    return styles
