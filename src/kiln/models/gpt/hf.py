"""kiln's GPT under Hugging Face names.

A dense GPT is a Llama (``LlamaForCausalLM``) weight for weight (a Qwen3 with model.qk_norm, an
Arcee with model.mlp=relu2). Both rotate the pairs
(x[i], x[i + head_dim / 2]) of each head ("rotate half") with the same frequencies, so no q/k
permutation is needed; grouped-query heads are shared the same way (each key/value head serves
consecutive query heads); a tied output layer is not stored twice, the config's
``tie_word_embeddings`` says so.

A mixture of experts becomes the ``transformers`` architecture that computes its layers with
Llama's attention (``hf_adapter`` chooses, or refuses naming the setting that none computes):
sigmoid routing is GLM-4.5's (``Glm4MoeForCausalLM``: DeepSeek-V3's router, bias included);
softmax routing is Mixtral's where that fits (every layer routed, no shared expert, no bias),
otherwise ERNIE 4.5's (``Ernie4_5_MoeForCausalLM``: a bias for the choice, shared experts,
dense first layers).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from kiln.models.family import ExportError, StateDictAdapter
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
    "attn.q_norm": "self_attn.q_norm",  # with model.qk_norm (Qwen3)
    "attn.k_norm": "self_attn.k_norm",
}
ROOT_NAMES = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
# The Hugging Face names of the query and key projections.
QK = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")


def _rename(name: str, block: Mapping[str, str], root: Mapping[str, str], blocks: str, hf_blocks: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module.startswith(blocks + "."):
        index, _, inner = module[len(blocks) + 1 :].partition(".")
        if inner in block:
            return f"{hf_blocks}.{index}.{block[inner]}.{leaf}"
    elif module in root:
        return f"{root[module]}.{leaf}"
    raise KeyError(f"no Hugging Face name for weight {name!r}")


def hf_adapter(cfg: GPTConfig) -> LlamaAdapter:
    """The names and config of the ``transformers`` architecture that computes ``cfg``'s model;
    ExportError, naming the setting, where none does."""
    if cfg.logit_softcap:
        raise ExportError(
            f"model.logit_softcap={cfg.logit_softcap}: the transformers architectures kiln's GPT exports as "
            "(Llama, Qwen3 and the mixtures of experts) do not soft-cap their logits"
        )
    if cfg.mlp == "relu2":
        if cfg.qk_norm or cfg.n_experts:
            raise ExportError(
                f"model.mlp=relu2 with {'model.qk_norm' if cfg.qk_norm else 'a mixture of experts'}: the one "
                "transformers architecture with kiln's ReLU² MLP (Arcee) has neither"
            )
        return ArceeAdapter(cfg)
    if cfg.qk_norm:
        if cfg.n_experts:
            raise ExportError(
                "model.qk_norm with a mixture of experts: the transformers architectures kiln exports a mixture "
                "of experts as (GLM-4.5, Mixtral, ERNIE 4.5) normalise no queries and keys"
            )
        return Qwen3Adapter(cfg)
    if not cfg.n_experts:
        return LlamaAdapter(cfg)
    if cfg.expert_capacity:
        raise ExportError(
            f"model.expert_capacity={cfg.expert_capacity}: kiln's mixture of experts drops the tokens past an "
            "expert's capacity, which no transformers architecture does"
        )
    if cfg.router == "sigmoid":
        if cfg.n_experts < 2:
            raise ExportError(
                f"model.n_experts={cfg.n_experts} with model.router=sigmoid: GLM-4.5's router "
                "(Glm4MoeForCausalLM), the one that computes kiln's sigmoid routing, needs 2 experts or more"
            )
        return Glm4MoeAdapter(cfg)
    if cfg.experts_per_token == 1:
        raise ExportError(
            "model.experts_per_token=1 with model.router=softmax: kiln weighs the one expert by its softmax "
            "score, where Mixtral and ERNIE 4.5 MoE (the architectures of softmax routing with kiln's "
            "attention) weigh it 1"
        )
    if not (cfg.n_shared_experts or cfg.moe_layer_start or cfg.router_bias_rate):
        return MixtralAdapter(cfg)
    return Ernie45MoeAdapter(cfg)


class LlamaAdapter(StateDictAdapter):
    block_names: Mapping[str, str] = BLOCK_NAMES

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {_rename(k, self.block_names, ROOT_NAMES, "blocks", "model.layers"): v for k, v in state.items()}
        if self.cfg.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        block = {v: k for k, v in self.block_names.items()}
        root = {v: k for k, v in ROOT_NAMES.items()}
        out = {_rename(k, block, root, "model.layers", "blocks"): v for k, v in state.items()}
        if self.cfg.tie_embeddings:
            out["lm_head.weight"] = out["tok_emb.weight"]
        return out

    def hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **self._common_config(),
            "intermediate_size": self.cfg.d_ff,
            "attention_bias": False,
            "mlp_bias": False,
        }

    def cut_config(self, layers: list[int]) -> dict[str, Any]:
        # The dense layers come first: as many of the kept ones stay dense.
        dense = sum(not self.cfg.is_moe(i) for i in layers)
        cut = dataclasses.replace(self.cfg, n_layer=len(layers), moe_layer_start=dense)
        return type(self)(cut).hf_config()

    def _common_config(self) -> dict[str, Any]:
        """The config keys that every architecture kiln's GPT exports as reads alike."""
        cfg = self.cfg
        return {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
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
            "torch_dtype": "float32",
        }


class Qwen3Adapter(LlamaAdapter):
    """A dense GPT with model.qk_norm is a Qwen3 (``Qwen3ForCausalLM``): Llama's layers with an
    RMSNorm over each head's queries and keys before the rotary embedding, as kiln's."""

    def hf_config(self) -> dict[str, Any]:
        return {
            **super().hf_config(),
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "use_sliding_window": False,
            "max_window_layers": self.cfg.n_layer,
        }


class ArceeAdapter(LlamaAdapter):
    """A dense GPT with model.mlp=relu2 is an Arcee (``ArceeForCausalLM``): Llama's layers with an
    ungated MLP, down_proj(relu(up_proj x)^2), as kiln's w2(relu(w1 x)^2)."""

    block_names = {**{k: v for k, v in BLOCK_NAMES.items() if k != "mlp.w3"}, "mlp.w1": "mlp.up_proj"}

    def hf_config(self) -> dict[str, Any]:
        arcee = {"architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_act": "relu2"}
        return {**super().hf_config(), **arcee}


class MoEAdapter(LlamaAdapter):
    """A mixture-of-experts GPT as a ``transformers`` MoE whose attention, norms and dense layers
    are Llama's. Each expert is stored on its own (``{moe}.experts.{j}.gate_proj.weight``...), as
    the Hub stores them: ``transformers`` 5 fuses them into 3D tensors as it loads them, older
    versions and other tools read them as they are."""

    moe = "mlp"  # the mixture of experts' module in a layer
    experts = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # each expert's projections
    bias = "gate.e_score_correction_bias"  # where ``expert_bias`` goes, within ``moe``
    # kiln name -> Hugging Face name, within a layer's mixture of experts: its router and shared experts.
    names = {
        "router.weight": "gate.weight",
        "shared.w1.weight": "shared_experts.gate_proj.weight",
        "shared.w3.weight": "shared_experts.up_proj.weight",
        "shared.w2.weight": "shared_experts.down_proj.weight",
    }

    def _moe_tensor(self, name: str, blocks: str, moe: str) -> tuple[int, str] | None:
        """The layer of ``name`` and its name within the layer's mixture of experts (``moe``),
        where it is a tensor of one (``blocks``: kiln's or Hugging Face's layers); else None."""
        found = re.fullmatch(rf"{re.escape(blocks)}\.(\d+)\.{re.escape(moe)}\.(.+)", name)
        if found is None or not self.cfg.is_moe(int(found[1])):
            return None
        return int(found[1]), found[2]

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            found = self._moe_tensor(name, "blocks", "mlp")
            if found is None:
                out.update(super().to_hf({name: tensor}))
                continue
            layer, inner = found
            prefix = f"model.layers.{layer}.{self.moe}."
            if inner.startswith("experts."):
                proj = self.experts[inner.removeprefix("experts.")]
                out.update({f"{prefix}experts.{j}.{proj}.weight": w for j, w in enumerate(tensor.unbind(0))})
            elif inner == "expert_bias":
                out.update(self._bias_to_hf(layer, tensor))
            else:
                out[prefix + self.names[inner]] = tensor
        return out

    def _bias_to_hf(self, layer: int, bias: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"model.layers.{layer}.{self.moe}.{self.bias}": bias}

    def _bias_from_hf(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = {v: k for k, v in self.names.items()}
        projections = {v: k for k, v in self.experts.items()}
        rest: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in state.items():
            found = self._moe_tensor(name, "model.layers", self.moe)
            if found is None:
                rest[name] = tensor
                continue
            layer, inner = found
            prefix = f"blocks.{layer}.mlp."
            expert = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", inner)
            if expert is not None and expert[2] in projections:
                experts.setdefault(f"{prefix}experts.{projections[expert[2]]}", {})[int(expert[1])] = tensor
            elif inner == self.bias:
                out[prefix + "expert_bias"] = self._bias_from_hf(tensor)
            elif inner in names:
                out[prefix + names[inner]] = tensor
            else:
                raise KeyError(f"no kiln name for Hugging Face weight {name!r}")
        for name, each in experts.items():
            out[name] = torch.stack([each[j] for j in range(self.cfg.n_experts)])
        return {**super().from_hf(rest), **out}


class Glm4MoeAdapter(MoEAdapter):
    """GLM-4.5's MoE (``Glm4MoeForCausalLM``) computes kiln's sigmoid routing: the top k of the
    sigmoid scores plus ``e_score_correction_bias`` (kiln's ``expert_bias``), weighted by their
    scores, renormalized when ``norm_topk_prob``; one group of experts (``n_group`` 1), no scaling
    of the routed output, the shared experts as one MLP; the layers before
    ``first_k_dense_replace`` dense. Its attention is Llama's when the whole head is rotated
    (``partial_rotary_factor`` 1) and without q/k norms."""

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().to_hf(state)
        if self.cfg.n_shared_experts:
            return out
        # GLM-4.5's mixture always has shared experts: kiln's none are written as zero-width
        # ones, which add nothing, so that transformers finds every tensor it builds.
        d = self.cfg.d_model
        for name, router in state.items():
            found = self._moe_tensor(name, "blocks", "mlp")
            if found is not None and found[1] == "router.weight":
                prefix = f"model.layers.{found[0]}.{self.moe}.shared_experts."
                out[f"{prefix}gate_proj.weight"] = out[f"{prefix}up_proj.weight"] = router.new_zeros(0, d)
                out[f"{prefix}down_proj.weight"] = router.new_zeros(d, 0)
        return out

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.cfg.n_shared_experts:  # the zero-width shared experts stand for none
            state = {name: t for name, t in state.items() if f".{self.moe}.shared_experts." not in name}
        return super().from_hf(state)

    def hf_config(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            **self._common_config(),
            "intermediate_size": cfg.d_ff,
            "moe_intermediate_size": cfg.d_expert,
            "n_routed_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "n_shared_experts": cfg.n_shared_experts,
            "first_k_dense_replace": cfg.moe_layer_start,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": cfg.experts_per_token > 1,
            "routed_scaling_factor": 1.0,
            "partial_rotary_factor": 1.0,
            "attention_bias": False,
            "use_qk_norm": False,
            "num_nextn_predict_layers": 0,
        }


class MixtralAdapter(MoEAdapter):
    """Mixtral (``MixtralForCausalLM``): the top k of the softmax scores, renormalized; every
    layer a mixture of experts, none shared, no bias; Llama's attention (no sliding window)."""

    moe = "block_sparse_moe"
    experts = {"w1": "w1", "w3": "w3", "w2": "w2"}

    def _bias_to_hf(self, layer: int, bias: torch.Tensor) -> dict[str, torch.Tensor]:
        # Chosen for model.router_bias_rate 0, which leaves the bias at 0 unless it moved before.
        if not bias.is_meta and bias.any():
            raise ExportError(
                f"blocks.{layer}.mlp.expert_bias is not zero (model.router_bias_rate=0 now, not when it moved): "
                "Mixtral, the architecture of softmax routing without shared experts, has no expert bias"
            )
        return {}

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().from_hf(state)
        for layer in range(self.cfg.n_layer):
            out[f"blocks.{layer}.mlp.expert_bias"] = torch.zeros(self.cfg.n_experts)
        return out

    def hf_config(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **self._common_config(),
            "intermediate_size": cfg.d_expert,
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }


class Ernie45MoeAdapter(MoEAdapter):
    """ERNIE 4.5's MoE (``Ernie4_5_MoeForCausalLM``): the top k of the softmax scores plus
    ``e_score_correction_bias`` (kiln's ``expert_bias``), weighted by their scores renormalized;
    the shared experts as one MLP; the layers before ``moe_layer_start_index`` dense. Its rotary
    embedding turns the pairs (x[2i], x[2i + 1]) of a head where kiln's turns (x[i],
    x[i + head_dim / 2]), by the same angle: the rows of each query and key head are interleaved
    to match, which leaves the attention scores as they were."""

    bias = "moe_statics.e_score_correction_bias"  # [1, n_experts]: one group of experts

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hd = self.cfg.head_dim
        return {name: _interleave(t, hd) if name.endswith(QK) else t for name, t in super().to_hf(state).items()}

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hd = self.cfg.head_dim
        return super().from_hf({name: _halves(t, hd) if name.endswith(QK) else t for name, t in state.items()})

    def _bias_to_hf(self, layer: int, bias: torch.Tensor) -> dict[str, torch.Tensor]:
        return super()._bias_to_hf(layer, bias[None])

    def _bias_from_hf(self, bias: torch.Tensor) -> torch.Tensor:
        return bias[0]

    def hf_config(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "architectures": ["Ernie4_5_MoeForCausalLM"],
            "model_type": "ernie4_5_moe",
            **self._common_config(),
            "intermediate_size": cfg.d_ff,
            "moe_intermediate_size": cfg.d_expert,
            "moe_num_experts": cfg.n_experts,
            "moe_k": cfg.experts_per_token,
            "moe_num_shared_experts": cfg.n_shared_experts,
            "moe_layer_start_index": cfg.moe_layer_start,
            "moe_layer_end_index": cfg.n_layer - 1,
            "moe_layer_interval": 1,
            "use_bias": False,
        }


def _interleave(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (head, i) and (head, i + head_dim / 2) of a query or key projection made rows
    (head, 2i) and (head, 2i + 1)."""
    return weight.view(-1, 2, head_dim // 2, weight.size(-1)).transpose(1, 2).reshape(weight.shape)


def _halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``_interleave`` undone."""
    return weight.view(-1, head_dim // 2, 2, weight.size(-1)).transpose(1, 2).reshape(weight.shape)
