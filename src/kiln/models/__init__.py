"""Models: the family interface (family.py), kiln's GPT family (gpt/), the fused output layer
and loss, what causal language models share (lm.py), and the decoder that samples from them
(decode.py)."""

from kiln.models.family import (
    HeadMemory,
    MemoryContext,
    MemoryModel,
    ModelFamily,
    ParallelPlan,
    StateDictAdapter,
    build_model,
    check_model_config,
    family_of,
    get_family,
    materialize,
)
from kiln.models.gpt import GPT, PRESETS, GPTConfig, build_gpt_config, flops_per_token, param_count

__all__ = [
    "GPT",
    "GPTConfig",
    "HeadMemory",
    "MemoryContext",
    "MemoryModel",
    "ModelFamily",
    "PRESETS",
    "ParallelPlan",
    "StateDictAdapter",
    "build_gpt_config",
    "build_model",
    "check_model_config",
    "family_of",
    "flops_per_token",
    "get_family",
    "materialize",
    "param_count",
]
