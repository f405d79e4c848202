"""kiln's own model family, ``gpt``: a Llama-style decoder-only Transformer (model.py), its named
sizes (presets.py), what it keeps in memory for ``kiln plan`` (memory.py) and its Hugging Face
names (hf.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from kiln.config import ModelConfig
from kiln.models.decode import SlotCache
from kiln.models.family import ModelFamily, ParallelPlan
from kiln.models.gpt.hf import LlamaAdapter, hf_adapter
from kiln.models.gpt.memory import GPTMemory
from kiln.models.gpt.model import GPT, GPTConfig
from kiln.models.gpt.parallelize import block_styles, root_styles
from kiln.models.gpt.presets import PRESETS, build_gpt_config, param_count

__all__ = ["FAMILY", "GPT", "GPTConfig", "GPTFamily", "PRESETS", "build_gpt_config", "flops_per_token", "param_count"]


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, in the PaLM / nanoGPT convention::

        6 * N + 12 * n_layer * d_model * seq_len

    N counts the parameters of every matmul a token goes through: the attention and MLP
    projections of each layer (of a mixture of experts, the router, the shared experts and the
    ``experts_per_token`` it is routed to) and the lm_head (tied or not); not the input embedding
    (a lookup) nor the norms' gains. Each such weight costs 2 FLOPs per token forward (multiply and add) and
    4 backward (gradients of input and weight): 6 * N. The second term is attention itself,
    QK^T and AV, 2 * 2 * d_model * seq_len per layer forward, times 3 with the backward;
    the causal mask's skipped half is counted too, as is conventional.
    """
    norm_gains = (2 * cfg.n_layer + 1) * cfg.d_model
    # A tied matrix is counted once, as the lm_head's; an untied input embedding is only a lookup.
    input_embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    n_matmul = param_count(cfg, active=True) - norm_gains - input_embedding
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


class GPTFamily(ModelFamily):
    name = "gpt"

    def resolve(self, model_cfg: ModelConfig, *, vocab_size: int, seq_len: int) -> GPTConfig:
        return build_gpt_config(model_cfg, vocab_size=vocab_size, max_seq_len=seq_len)

    def build(self, args: GPTConfig) -> GPT:
        return GPT(args)

    def args_to_dict(self, args: GPTConfig) -> dict[str, Any]:
        return dataclasses.asdict(args)

    def args_from_dict(self, values: Mapping[str, Any]) -> GPTConfig:
        return GPTConfig(**values)

    def describe(self, model_cfg: ModelConfig, args: GPTConfig, model: nn.Module) -> str:
        gpt = cast(GPT, model)  # this family's model
        experts = (
            f", {args.n_experts} experts ({args.experts_per_token} a token, {args.n_shared_experts} shared; "
            f"{param_count(args, active=True):,} parameters active)"
            if args.n_experts
            else ""
        )
        return (
            f"{model_cfg.preset}: {gpt.num_params():,} parameters "
            f"({gpt.num_params(exclude_embedding=True):,} without embeddings), "
            f"{args.n_layer} layers, d_model {args.d_model}, vocab {args.vocab_size}{experts}"
        )

    def parallel_plan(self, args: GPTConfig) -> ParallelPlan:
        """Tensor parallelism with sequence parallelism, a vocabulary-parallel embedding and
        output layer and loss parallelism (``kiln.models.gpt.parallelize``). The RoPE tables are
        derived buffers. A pipeline's first stage holds the embedding, its last the final norm
        and output layer."""
        divisors = {f"model.{key}": getattr(args, key) for key in ("n_head", "n_kv_head", "d_ff")}
        if args.n_experts:
            # A mixture of experts is not split: each tensor-parallel rank runs it whole.
            divisors.pop("model.d_ff")
        return ParallelPlan(
            blocks="blocks",
            tensor_parallel=block_styles,
            tp_root=root_styles,
            loss="head_loss",
            sequence_parallel=True,
            tp_divisors=divisors,
            derived_buffers=True,
            pipeline_first=("tok_emb",),
            pipeline_last=("norm", "lm_head"),
            # The balance loss of a stage's layers would not reach the last stage's loss.
            unpipelined="model.router_aux_loss is not carried between pipeline stages; set it to 0 "
            "(model.router_bias_rate balances the experts without a loss) or parallel.pp=1"
            if args.router_aux_loss and args.n_experts
            else "",
            experts="mlp.experts" if args.n_experts else "",
            n_experts=args.n_experts,
            attention="attn.core",
        )

    def flops_per_token(self, args: GPTConfig, seq_len: int) -> float:
        return flops_per_token(args, seq_len)

    def memory_model(self, args: GPTConfig) -> GPTMemory:
        return GPTMemory(args)

    def head_dim(self, args: GPTConfig) -> int:
        return args.head_dim

    def state_dict_adapter(self, args: GPTConfig) -> LlamaAdapter:
        """A Llama's names, or those of the MoE architecture that computes the model's mixtures of
        experts (ExportError naming the setting that none does)."""
        return hf_adapter(args)

    def context_length(self, args: GPTConfig) -> int:
        return args.max_seq_len

    def lora_targets(self, args: GPTConfig) -> list[str]:
        return ["wq", "wk", "wv", "wo", "w1", "w2", *(["w3"] if args.mlp == "swiglu" else [])]

    def decoding(self, model: nn.Module) -> GPTDecoding:
        return GPTDecoding(model)


@dataclasses.dataclass(frozen=True)
class GPTDecoding:
    """kiln's GPT under the decoder: its forward takes the bound cache as ``kv_cache``."""

    module: nn.Module

    @property
    def context(self) -> int:
        return cast(GPT, self.module).config.max_seq_len

    def forward(self, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        return self.module(tokens, kv_cache=cache, logits_to_keep=1)[:, -1]


FAMILY = GPTFamily()
