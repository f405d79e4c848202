"""How kiln's GPT splits over tensor-parallel ranks, as PyTorch's ``ParallelStyle`` objects
(``torch.distributed.tensor.parallel``): Megatron's tensor parallelism with sequence parallelism
and a vocabulary-parallel embedding and output layer, as torchtitan lays out Llama.

Inside each block, q, k, v and the MLP's input projections split column-wise (a rank owns whole
heads and a slice of the hidden units) and the output projections row-wise. Between them the
residual stream is split by position (sequence parallelism): each norm runs on a rank's
positions, the input of the attention and of the MLP is gathered (all-gather), and the output
projections' sums are scattered back by position (reduce-scatter), which moves what an
all-reduce moves, in two halves, while the activations between blocks are a tp-th of their size.
The embedding's rows (the vocabulary) are split over the ranks, its output scattered by
position; the output layer's rows are split the same way, and its loss is computed on them
(``kiln.distributed.loss_parallel``). A mixture of experts is not split: each rank runs it on the
gathered positions and keeps its own. With QK-norm, the per-head norms run on each rank's heads,
their shared gains' gradients summed over the ranks.

The styles are built here, in the family; the model itself imports nothing distributed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.models.gpt.moe import MoE


def root_styles(model: nn.Module) -> dict[str, Any]:
    """The styles of the modules outside the blocks, by their name in the model (any GPT's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Logits (evaluation without targets): every rank's rows gathered. The loss never calls it.
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def block_styles(block: nn.Module) -> dict[str, Any]:
    """The styles of one block's modules, by their name in the block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gathered(args: int) -> dict[str, Any]:
        """The first of ``args`` inputs gathered from every rank's positions, the rest as given."""
        rest = (None,) * (args - 1)
        return {"input_layouts": (Shard(1), *rest), "desired_input_layouts": (Replicate(), *rest)}

    styles: dict[str, Any] = {
        "attn_norm": SequenceParallel(),
        # x, rope_cos, rope_sin, cache, documents
        "attn": PrepareModuleInput(**gathered(5), use_local_output=True),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
    }
    attn = block.get_submodule("attn")
    if hasattr(attn, "q_norm"):
        # [B, T, heads, head_dim]: a rank's heads; the gains are shared by every head.
        styles["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        styles["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    mlp = block.get_submodule("mlp")
    if isinstance(mlp, MoE):
        # Whole on every rank, on the gathered positions (x, losses); each keeps its own of the result.
        styles["mlp"] = PrepareModuleInputOutput(
            **gathered(2),
            use_local_input=True,
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
            use_local_output=True,
        )
        return styles
    styles["mlp"] = PrepareModuleInput(**gathered(2), use_local_output=True)
    styles["mlp.w1"] = ColwiseParallel()
    if getattr(mlp, "w3", None) is not None:
        styles["mlp.w3"] = ColwiseParallel()
    styles["mlp.w2"] = RowwiseParallel(output_layouts=Shard(1))
    return styles
