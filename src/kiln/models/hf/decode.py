"""``transformers``' causal LMs under kiln's decoder (``kiln.models.decode``): the model's own
forward, given the rows' positions as ``position_ids``, their mask as a 4-D attention mask (which
``transformers`` takes as it is) and, as its cache, one of ``transformers``' ``Cache`` classes
whose layers store into kiln's ``SlotCache``."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.models.decode import SlotCache
from kiln.models.hf.loading import transformers_module


@functools.cache
def _slot_cache_class() -> type:
    """A ``transformers`` ``Cache`` over a ``SlotCache`` (made once transformers is imported)."""
    base = transformers_module().cache_utils.Cache

    class HFSlotCache(base):  # type: ignore[misc, valid-type]
        """Each attention layer's ``update`` stores its keys and values into the bound slots and
        gets back those the queries attend to; the mask comes with the inputs."""

        def __init__(self, slots: SlotCache):
            super().__init__(layers=[])
            self.slots = slots

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values, _ = self.slots.attend(layer_idx, key_states, value_states)
            return keys, values

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # positions come as position_ids, the mask as a 4-D mask: nothing reads this

    return HFSlotCache


@dataclass(frozen=True)
class HFDecoding:
    """A ``transformers`` causal LM (``module``, under PEFT's wrapper or not) under the decoder."""

    module: nn.Module

    @property
    def context(self) -> int | None:
        return getattr(self.module.config, "max_position_embeddings", None)

    def forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        dtype = next(self.module.parameters()).dtype
        if not dtype.is_floating_point:
            dtype = torch.float32

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            """[B, 1, T, columns], as every attention implementation of transformers takes it."""
            return torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill_(
                ~allowed, torch.finfo(dtype).min
            )[:, None]

        config = self.module.config
        window = getattr(config, "sliding_window", None)
        kinds = set(getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
        mask: torch.Tensor | dict[str, torch.Tensor]
        if "sliding_attention" not in kinds or not window:
            mask = additive(cache.mask)
        elif kinds == {"sliding_attention"}:  # every layer local (Mistral)
            mask = additive(cache.window_mask(window))
        else:  # local and global layers (Gemma, Qwen2's windowed layers): a mask for each kind
            mask = {"full_attention": additive(cache.mask), "sliding_attention": additive(cache.window_mask(window))}
        keywords = _keywords(type(self.module).forward)
        # transformers 5.24 renamed past_key_values to cache (the old name warns on every call).
        extra = {"cache" if "cache" in keywords else "past_key_values": _slot_cache_class()(cache)}
        if "logits_to_keep" in keywords:
            extra["logits_to_keep"] = 1
        out = self.module(input_ids=tokens, position_ids=cache.positions, attention_mask=mask, use_cache=True, **extra)
        return out.logits[:, -1]


@functools.cache
def _keywords(forward: Any) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)
