import dataclasses
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError, ModelConfig
from kiln.device import peak_flops
from kiln.models import GPT, PRESETS, build_gpt_config, flops_per_token, param_count

VOCAB = 32000


def meta_model(cfg):
    with torch.device("meta"):
        return GPT(cfg)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_matches_model_for_every_preset(preset):
    cfg = build_gpt_config(ModelConfig(preset=preset), VOCAB, 128)
    model = meta_model(cfg)
    assert param_count(cfg) == model.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_embeddings="true"),
        dict(tie_embeddings="false"),
        dict(n_kv_head=2),
        dict(n_kv_head=1, tie_embeddings="false"),
    ],
)
def test_param_count_matches_model_for_tiny_variants(overrides):
    cfg = build_gpt_config(ModelConfig(preset="tiny", **overrides), VOCAB, 128)
    model = meta_model(cfg)
    assert param_count(cfg) == model.num_params()
    assert model.num_params(exclude_embedding=True) == param_count(cfg) - VOCAB * cfg.d_model


def test_overrides_and_context_length():
    cfg = build_gpt_config(
        ModelConfig(
            preset="tiny",
            n_layer=2,
            d_model=64,
            n_head=2,
            n_kv_head=1,
            d_ff=96,
            tie_embeddings="false",
            rope_theta=500.0,
        ),
        vocab_size=100,
        max_seq_len=4096,
    )
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_ff) == (2, 64, 2, 1, 96)
    assert cfg.tie_embeddings is False and cfg.rope_theta == 500.0 and cfg.head_dim == 32
    assert cfg.max_seq_len == 4096
    assert build_gpt_config(ModelConfig(preset="tiny"), 100, 16).max_seq_len == PRESETS["tiny"]["max_seq_len"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(n_head=6, n_kv_head=6), ["model.n_head: 6 does not divide model.d_model 128"]),
        (dict(n_kv_head=3), ["model.n_kv_head: 3 does not divide model.n_head 4"]),
        (dict(d_model=96, n_head=32), ["model.n_head: head dim"]),
        (dict(n_layer=-1, tie_embeddings="yes"), ["model.n_layer:", "model.tie_embeddings:"]),
        (dict(preset="huge"), ["model.preset: 'huge'"]),
    ],
)
def test_bad_dimensions_raise_config_error_naming_keys(overrides, expected):
    with pytest.raises(ConfigError) as info:
        build_gpt_config(ModelConfig(**overrides), VOCAB, 128)
    assert len(info.value.errors) == len(expected)
    for line, start in zip(info.value.errors, expected, strict=True):
        assert line.startswith(start)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_gpt_config(ModelConfig(d_model=100, n_head=8, n_kv_head=3), VOCAB, 128)
    assert [e.split(":")[0] for e in info.value.errors] == ["model.n_head", "model.n_kv_head"]


def test_flops_per_token_gpt2_124m():
    cfg = build_gpt_config(ModelConfig(preset="gpt2-124m"), 50257, 1024)
    L, d, V, ff = 12, 768, 50257, 2048  # noqa: N806
    n_matmul = L * (4 * d * d + 3 * d * ff) + V * d
    assert flops_per_token(cfg, 1024) == 6 * n_matmul + 12 * L * d * 1024
    # GPT-2 small: ~124M parameters, and attention adds ~10% at a 1024-token context.
    assert 120e6 < param_count(cfg) < 130e6
    assert 1.05 < flops_per_token(cfg, 1024) / (6 * param_count(cfg)) < 1.25
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    assert flops_per_token(untied, 1024) == flops_per_token(cfg, 1024)


def test_peak_flops_is_none_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_model_code_does_not_use_torch_distributed():
    """A family lays its model out with PyTorch's styles in its own parallelize.py; the rest of
    kiln.models (the models themselves, the family interface) uses nothing distributed."""
    sources = Path(__file__).parents[2] / "src" / "kiln" / "models"
    files = sorted(p for p in sources.rglob("*.py") if p.name != "parallelize.py")
    assert files and (sources / "gpt" / "parallelize.py").is_file()
    for path in files:
        assert "torch.distributed" not in path.read_text(), path
