"""``transformers``' causal LMs under kiln's decoder (``kiln.models.decode``): the model's own
forward, given the rows' positions as ``position_ids``, their mask as a 4-D attention mask (which
``transformers`` takes as it is) and, as its cache, one of ``transformers``' ``Cache`` classes
whose layers store into kiln's ``SlotCache``."""

from __future__ import annotations

import functools
import inspect
from typing import cast

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

        def __init__(self) -> None:
            super().__init__(layers=[])
            self.slots: SlotCache | None = None  # the bound cache, set before each forward

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            assert self.slots is not None
            keys, values, _ = self.slots.attend(layer_idx, key_states, value_states)
            return keys, values

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # positions come as position_ids, the mask as a 4-D mask: nothing reads this

    return HFSlotCache


class HFDecoding:
    """A ``transformers`` causal LM ``model`` under the decoder, called through ``module``, kiln's
    wrapper of it (which passes the decoder's keywords on; see ``CausalLM.forward``). What the
    model's config and forward say (its masks' type, its sliding window and which layers have it,
    its keywords) is read once, not at each step."""

    def __init__(self, module: nn.Module, model: nn.Module):
        self.module = module
        config = model.config
        self.context: int | None = getattr(config, "max_position_embeddings", None)
        dtype = next(model.parameters()).dtype
        self.dtype = dtype if dtype.is_floating_point else torch.float32
        self.window: int | None = getattr(config, "sliding_window", None)
        kinds = set(getattr(config, "layer_types", None) or ["sliding_attention" if self.window else "full_attention"])
        # full: no layer has a window; local: every layer does (Mistral); mixed: a mask for each
        # kind of layer (Gemma, Qwen2's windowed layers).
        self.layers = (
            "full"
            if "sliding_attention" not in kinds or not self.window
            else "local"
            if kinds == {"sliding_attention"}
            else "mixed"
        )
        keywords = inspect.signature(type(model).forward).parameters
        # transformers 5.24 renamed past_key_values to cache (the old name warns on every call).
        self.cache_keyword = "cache" if "cache" in keywords else "past_key_values"
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in keywords else {}
        # Made once: making a transformers Cache logs, which a compiled step could not trace.
        self.cache = _slot_cache_class()()

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, columns], as every attention implementation of transformers takes it."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min
        )[:, None]

    def forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        mask: torch.Tensor | dict[str, torch.Tensor]
        if self.layers == "full":
            mask = self._additive(cache.mask)
        elif self.layers == "local":
            mask = self._additive(cache.window_mask(cast(int, self.window)))
        else:
            local = self._additive(cache.window_mask(cast(int, self.window)))
            mask = {"full_attention": self._additive(cache.mask), "sliding_attention": local}
        self.cache.slots = cache
        keywords = {self.cache_keyword: self.cache, **self.last_only}
        logits = self.module(tokens, position_ids=cache.positions, attention_mask=mask, decoding=keywords)
        return logits[:, -1]
