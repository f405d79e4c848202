"""Named model sizes, and turning the user's ``[model]`` section into a validated GPTConfig."""

from __future__ import annotations

from kiln.config import ConfigError, ModelConfig
from kiln.models.gpt.model import MLPS, GPTConfig

# Dimensions only: the vocabulary comes from the tokenizer. d_ff of the GPT-2-class sizes is
# 8/3 * d_model (rounded up to a multiple of 256), which gives a SwiGLU MLP the parameter count
# of GPT-2's 4 * d_model GELU MLP.
# The table is aligned by hand: the formatter leaves it alone and its rows may exceed the line length.
# ruff: disable[E501]
# fmt: off
PRESETS: dict[str, dict] = {
    "tiny":      dict(n_layer=4,  d_model=128,  n_head=4,  n_kv_head=4,  d_ff=384,   max_seq_len=1024, rope_theta=10000.0,  tie_embeddings=True),
    "small":     dict(n_layer=6,  d_model=256,  n_head=4,  n_kv_head=4,  d_ff=768,   max_seq_len=1024, rope_theta=10000.0,  tie_embeddings=True),
    "gpt2-124m": dict(n_layer=12, d_model=768,  n_head=12, n_kv_head=12, d_ff=2048,  max_seq_len=1024, rope_theta=10000.0,  tie_embeddings=True),
    "350m":      dict(n_layer=24, d_model=1024, n_head=16, n_kv_head=16, d_ff=2816,  max_seq_len=2048, rope_theta=10000.0,  tie_embeddings=True),
    "1b":        dict(n_layer=16, d_model=2048, n_head=32, n_kv_head=8,  d_ff=8192,  max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "7b":        dict(n_layer=32, d_model=4096, n_head=32, n_kv_head=32, d_ff=11008, max_seq_len=4096, rope_theta=10000.0,  tie_embeddings=False),
    # Shaped like Llama 3 (vocabulary 128,256: set data.vocab_size), for kiln plan and from-scratch runs.
    "llama3-8b":   dict(n_layer=32,  d_model=4096,  n_head=32,  n_kv_head=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    "llama3-70b":  dict(n_layer=80,  d_model=8192,  n_head=64,  n_kv_head=8, d_ff=28672, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    "llama3-405b": dict(n_layer=126, d_model=16384, n_head=128, n_kv_head=8, d_ff=53248, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    # Mixtures of experts. tiny-moe: the tests' and the CPU's, routed as DeepSeek-V3 routes (sigmoid
    # scores, a shared expert, the first layer dense). The others are shaped like the models they are
    # named after for kiln plan (their attention is kiln's: DeepSeek-V3's latent attention is not).
    "tiny-moe":      dict(n_layer=4,  d_model=128,  n_head=4,   n_kv_head=4,   d_ff=384,   max_seq_len=1024, rope_theta=10000.0,   tie_embeddings=True,  n_experts=8,   experts_per_token=2, n_shared_experts=1, d_expert=96,   moe_layer_start=1, router="sigmoid"),
    "qwen3-30b-a3b": dict(n_layer=48, d_model=2048, n_head=16,  n_kv_head=4,   d_ff=6144,  max_seq_len=4096, rope_theta=1000000.0, tie_embeddings=False, n_experts=128, experts_per_token=8, n_shared_experts=0, d_expert=768,  moe_layer_start=0, router="softmax"),
    "deepseek-v3":   dict(n_layer=61, d_model=7168, n_head=128, n_kv_head=128, d_ff=18432, max_seq_len=4096, rope_theta=10000.0,   tie_embeddings=False, n_experts=256, experts_per_token=8, n_shared_experts=1, d_expert=2048, moe_layer_start=3, router="sigmoid"),
}
# fmt: on
# ruff: enable[E501]


def build_gpt_config(model_cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> GPTConfig:
    """The preset's dimensions, overridden by every field the user set (non-zero, not "preset").

    The context is the longer of the preset's and the requested ``max_seq_len``. Raises
    ConfigError listing every invalid dimension, each line naming its ``model.*`` key.
    """
    if model_cfg.preset not in PRESETS:
        raise ConfigError([f"model.preset: {model_cfg.preset!r} is not one of {', '.join(PRESETS)}"])
    dims = dict(PRESETS[model_cfg.preset])
    errors = []
    for key in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "rope_theta", "n_experts", "experts_per_token"):
        value = getattr(model_cfg, key)
        if value < 0:
            errors.append(f"model.{key}: must be positive (or 0 for the preset's), got {value}")
        elif value > 0:
            dims[key] = value
    errors += _experts(model_cfg, dims)
    tie = model_cfg.tie_embeddings
    if tie in ("true", "false"):
        dims["tie_embeddings"] = tie == "true"
    elif tie != "preset":
        errors.append(f"model.tie_embeddings: {tie!r} is not one of true, false, preset")
    if model_cfg.logit_softcap < 0:
        errors.append(f"model.logit_softcap: must be >= 0 (0 is off), got {model_cfg.logit_softcap}")
    elif model_cfg.logit_softcap:
        dims["logit_softcap"] = model_cfg.logit_softcap
    if model_cfg.mlp in MLPS:
        dims["mlp"] = model_cfg.mlp
    elif model_cfg.mlp != "preset":
        errors.append(f"model.mlp: {model_cfg.mlp!r} is not one of {', '.join(MLPS)}, preset")
    for key in ("qk_norm", "zero_init"):
        value = getattr(model_cfg, key)
        if value in ("true", "false"):
            dims[key] = value == "true"
        elif value != "preset":
            errors.append(f"model.{key}: {value!r} is not one of true, false, preset")
    if dims.get("zero_init") and dims["tie_embeddings"]:
        errors.append(
            "model.zero_init: a tied output layer is the embedding table, which cannot start at zero; "
            "set model.tie_embeddings=false"
        )
    dims["max_seq_len"] = max(dims["max_seq_len"], max_seq_len)

    d_model, n_head, n_kv_head = dims["d_model"], dims["n_head"], dims["n_kv_head"]
    if d_model % n_head:
        errors.append(f"model.n_head: {n_head} does not divide model.d_model {d_model}")
    elif (d_model // n_head) % 2:
        errors.append(
            f"model.n_head: head dim model.d_model / model.n_head = {d_model // n_head} "
            "must be even for rotary embeddings"
        )
    if n_head % n_kv_head:
        errors.append(f"model.n_kv_head: {n_kv_head} does not divide model.n_head {n_head}")
    if errors:
        raise ConfigError(errors)
    return GPTConfig(vocab_size=vocab_size, **dims)


def _experts(model_cfg: ModelConfig, dims: dict) -> list[str]:
    """Fill the mixture-of-experts dimensions of ``dims`` (a preset's, with the user's sizes) from
    the ``[model]`` section; every invalid one, named."""
    errors = []
    for key in ("n_shared_experts", "moe_layer_start", "d_expert"):
        value, least = getattr(model_cfg, key), 0 if key == "d_expert" else -1
        if value < least:
            errors.append(f"model.{key}: must be >= 0 ({least} keeps the preset's), got {value}")
        elif value > least:
            dims[key] = value
    if model_cfg.router not in ("preset", "softmax", "sigmoid"):
        errors.append(f"model.router: {model_cfg.router!r} is not one of softmax, sigmoid, preset")
    elif model_cfg.router != "preset":
        dims["router"] = model_cfg.router
    for key in ("router_bias_rate", "router_aux_loss", "expert_capacity"):
        value = getattr(model_cfg, key)
        if value < 0:
            errors.append(f"model.{key}: must be >= 0, got {value}")
        dims[key] = value
    n_experts = dims.get("n_experts", 0)
    if not n_experts:
        return errors
    # A preset without experts given some: each expert as wide as its MLP, two a token (Mixtral's way).
    dims.setdefault("d_expert", dims["d_ff"])
    k = dims.setdefault("experts_per_token", 2)
    if k > n_experts:
        errors.append(f"model.experts_per_token: {k} is more than model.n_experts {n_experts}")
    if dims.get("moe_layer_start", 0) >= dims["n_layer"]:
        errors.append(
            f"model.moe_layer_start: {dims['moe_layer_start']} leaves no layer of model.n_layer {dims['n_layer']} "
            "a mixture of experts"
        )
    if 0 < model_cfg.expert_capacity * k < 1:
        errors.append(
            f"model.expert_capacity: {model_cfg.expert_capacity} gives each expert less than one token's share "
            f"(x experts_per_token {k} < 1); use 1.0 or more, or 0 for no capacity"
        )
    return errors


def param_count(cfg: GPTConfig, *, active: bool = False) -> int:
    """Closed-form parameter count of ``GPT(cfg)``; equals ``GPT(cfg).num_params()``. ``active``:
    those one token goes through (of a mixture of experts, its router, its shared experts and
    ``experts_per_token`` of the others)."""
    d, hd = cfg.d_model, cfg.head_dim
    attention = d * cfg.n_head * hd + 2 * d * cfg.n_kv_head * hd + cfg.n_head * hd * d
    dense = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff
    experts = cfg.experts_per_token if active else cfg.n_experts
    moe = d * cfg.n_experts + 3 * d * cfg.d_expert * (experts + cfg.n_shared_experts)
    mlps = sum(moe if cfg.is_moe(layer) else dense for layer in range(cfg.n_layer))
    per_layer = attention + 2 * d  # + the two norms' gains
    embedding = cfg.vocab_size * d
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return embedding + cfg.n_layer * per_layer + mlps + d + lm_head
