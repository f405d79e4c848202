"""How a Hugging Face Llama-class decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) splits over
tensor-parallel ranks, as PyTorch's ``ParallelStyle`` objects: Megatron's layout under the
projection names these architectures share, with sequence, vocabulary and loss parallelism as
kiln's GPT has them (torchtitan's layout of Llama).

The attention's and MLP's input projections split column-wise (a rank owns whole heads and a
slice of the hidden units), their output projections row-wise. A causal LM's residual stream
between them is split by position (sequence parallelism): each layer's norms run on a rank's
positions, the attention's and the MLP's inputs are gathered from every rank's, and the output
projections' sums are reduce-scattered back to positions. The stream stays a DTensor from the
embedding to the final norm, because transformers reads the sequence's length (for the causal
mask and the positions) from the embeddings' shape, and a DTensor's shape is the whole one. The
embedding's and output layer's rows (the vocabulary) split over the ranks, and kiln's fused
loss, put in place of the wrapper's, computes on them (``kiln.distributed.loss_parallel``).
Per-head query and key norms (Qwen3, Gemma 3) norm a rank's own heads. A classifier keeps the
layout without sequence parallelism (its head reads one position).

Phi-3 fuses its projections (qkv_proj: queries, keys and values; gate_up_proj: the MLP's two
input halves), which the model cuts by their sizes in the whole model: each rank computes a
slice of the fused output's columns, gathered whole (transformers' own "colwise_rep" plan for
Phi-3), and its output projections take their whole input and split it by rows. The weights and
the projections' work split over the ranks; the attention itself runs whole on every rank."""

from __future__ import annotations

import functools
from typing import Any, cast

from torch import nn

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3's
# Where the per-head query and key norms of a model type find the heads in their input: Qwen3
# norms [B, T, heads, head_dim], Gemma 3 after moving the heads first, [B, heads, T, head_dim].
QK_NORM_HEADS = {"qwen3": 2, "gemma3_text": 1}


def llama_styles(
    layer: nn.Module, qk_norm_heads: int | None = None, *, sequence_parallel: bool = False
) -> dict[str, Any]:
    """The styles of one decoder layer's modules, by their name in the layer. With per-head query
    and key norms (their heads at dim ``qk_norm_heads`` of the input), each rank norms its own
    heads with gains replicated over the ranks, whose gradients (a sum over each rank's heads)
    are summed across them. ``sequence_parallel``: the layer's input and output are split by
    position (DTensors), and its norms (every child named ``*layernorm``) run on a rank's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    fused = all(_has(layer, name) for name in FUSED)
    # The output projections' inputs: a rank's heads and hidden units, or (fused) every one.
    given: dict[str, Any] = {"input_layouts": Replicate()} if fused else {}
    styles: dict[str, Any] = (
        {name: ColwiseParallel(output_layouts=Replicate()) for name in FUSED}
        if fused
        else {name: ColwiseParallel() for name in COLWISE}
    )
    if sequence_parallel:
        styles |= {name: RowwiseParallel(output_layouts=Shard(1), use_local_output=False, **given) for name in ROWWISE}
        styles["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        styles["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        for name, _ in layer.named_children():
            if name.endswith("layernorm"):
                styles[name] = SequenceParallel(use_local_output=False)
    else:
        styles |= {name: RowwiseParallel(**given) for name in ROWWISE}
    attn = layer.get_submodule("self_attn")
    norms = [f"self_attn.{name}" for name in ("q_norm", "k_norm") if hasattr(attn, name)]
    if norms and qk_norm_heads is None:
        raise ValueError(f"{type(layer).__name__} norms its query and key heads at a place kiln does not know")
    for name in norms:
        styles[name] = SequenceParallel(sequence_dim=cast(int, qk_norm_heads), use_local_output=True)
    return styles


def llama_root_styles(decoder: str, head: str) -> dict[str, Any]:
    """A causal LM's modules outside its layers, by their paths (``decoder``: the decoder's, under
    its output layer ``head``): the embedding's rows split, its output a DTensor split by
    position; the final norm on a rank's positions (a plain tensor out, which a pipeline stage
    without the output layer sends on), and a later stage's input, those positions, made a
    DTensor again; the output layer's rows split (the logits gathered whole where they are
    asked for: the loss computes on the split rows instead)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        decoder: _embedded_by_position()(),
        f"{decoder}.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        f"{decoder}.norm": SequenceParallel(use_local_output=True),
        head: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


@functools.cache
def _embedded_by_position() -> type:
    """The decoder's style: hidden states given for ``inputs_embeds`` (a later pipeline stage's
    input: its rank's positions) made a DTensor split by position, as the embedding's output is.
    A custom style, since ``PrepareModuleInput`` refuses the ``inputs_embeds=None`` that a causal
    LM's own forward passes its decoder with token ids (the decoding path)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ParallelStyle

    class EmbeddedByPosition(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def split(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
                given = kwargs.get("inputs_embeds")
                if isinstance(given, torch.Tensor) and not isinstance(given, DTensor):
                    kwargs["inputs_embeds"] = DTensor.from_local(given, device_mesh, (Shard(1),), run_check=False)
                return args, kwargs

            module.register_forward_pre_hook(split, with_kwargs=True)
            return module

    return EmbeddedByPosition


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True
