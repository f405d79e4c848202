"""The model: a Llama-style GPT, its named sizes, FLOP accounting and sampling."""

from kiln.models.flops import flops_per_token
from kiln.models.generate import generate
from kiln.models.gpt import GPT, GPTConfig
from kiln.models.presets import PRESETS, build_gpt_config, param_count

__all__ = ["GPT", "GPTConfig", "build_gpt_config", "PRESETS", "param_count", "flops_per_token", "generate"]
