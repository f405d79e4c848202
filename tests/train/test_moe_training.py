"""tiny-moe trains in one process, and its routing bias evens the experts' load."""

from __future__ import annotations

import math

import pytest

from conftest import tiny_overrides
from kilnrun import in_process, records


def _train(run_dir, corpus_dir, rate: float) -> list[dict]:
    sets = tiny_overrides(
        run_dir,
        corpus_dir,
        model__preset="tiny-moe",
        model__n_layer=4,
        model__router_bias_rate=rate,
        train__max_steps=50,
        train__log_every=25,  # the load logged is the interval's: 25 steps of tokens
        train__lr=3e-3,
        eval__sample_tokens=0,
        checkpoint__every=0,
    )
    in_process("train", *[a for item in sets for a in ("--set", item)])
    return [r for r in records(run_dir) if "loss" in r]


@pytest.mark.slow
def test_balancing_keeps_every_expert_loaded_and_the_loss_falls(tmp_path, corpus_dir):
    balanced = _train(tmp_path / "balanced", corpus_dir, 0.01)
    free = _train(tmp_path / "free", corpus_dir, 0.0)
    for run in (balanced, free):
        assert run[-1]["loss"] < math.log(512) - 0.5  # from a guess over the 512 tokens (6.24)
    # After 50 steps no expert of any layer gets less than 20% of the mean load with the
    # balancing bias; left to itself, the router starves some.
    assert balanced[-1]["moe/min_load"] > 0.2, balanced[-1]["moe/load"]
    assert free[-1]["moe/min_load"] < 0.2, free[-1]["moe/load"]
    assert balanced[-1]["moe/imbalance"] < free[-1]["moe/imbalance"]
    assert set(balanced[-1]["moe/load"]) == {"blocks.1.mlp", "blocks.2.mlp", "blocks.3.mlp"}
    # Each token's normalized scores: between certainty (0) and no preference (ln 8).
    assert 0 < balanced[-1]["moe/router_entropy"] < math.log(8)
