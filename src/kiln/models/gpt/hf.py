"""kiln's GPT under Hugging Face names: it is a Llama (``LlamaForCausalLM``) weight for weight.

Both rotate the pairs (x[i], x[i + head_dim / 2]) of each head ("rotate half") with the same
frequencies, so no q/k permutation is needed; grouped-query heads are shared the same way (each
key/value head serves consecutive query heads); a tied output layer is not stored twice, the
config's ``tie_word_embeddings`` says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.models.family import StateDictAdapter
from kiln.models.gpt.model import GPTConfig

# kiln name -> Hugging Face name, within a block / at the root.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w3": "mlp.up_proj",
    "mlp.w2": "mlp.down_proj",
}
ROOT_NAMES = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}


def _rename(name: str, block: Mapping[str, str], root: Mapping[str, str], blocks: str, hf_blocks: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module.startswith(blocks + "."):
        index, _, inner = module[len(blocks) + 1 :].partition(".")
        if inner in block:
            return f"{hf_blocks}.{index}.{block[inner]}.{leaf}"
    elif module in root:
        return f"{root[module]}.{leaf}"
    raise KeyError(f"no Hugging Face name for weight {name!r}")


class LlamaAdapter(StateDictAdapter):
    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {_rename(k, BLOCK_NAMES, ROOT_NAMES, "blocks", "model.layers"): v for k, v in state.items()}
        if self.cfg.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        block = {v: k for k, v in BLOCK_NAMES.items()}
        root = {v: k for k, v in ROOT_NAMES.items()}
        out = {_rename(k, block, root, "model.layers", "blocks"): v for k, v in state.items()}
        if self.cfg.tie_embeddings:
            out["lm_head.weight"] = out["tok_emb.weight"]
        return out

    def hf_config(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
