"""A mixture of experts laid out over gloo ranks trains as one process does: the experts'
balancing bias moves by the load of every rank's tokens, the same everywhere."""

from __future__ import annotations

import pytest
import torch

from kilnrun import in_process
from layouts import assert_same_training, layout_sets, train_on, weights

pytestmark = pytest.mark.dist

# A bias rate high enough to change which experts tokens pick within the run's six steps.
MOE = dict(model__preset="tiny-moe", model__n_layer=2, model__router_bias_rate=0.05)


@pytest.fixture(scope="module")
def moe_single(tmp_path_factory, corpus_dir):
    run_dir = tmp_path_factory.mktemp("moe") / "one"
    in_process("train", *layout_sets(run_dir, corpus_dir, micro=4, **MOE))
    return run_dir


@pytest.mark.slow
def test_a_mixture_of_experts_on_two_fsdp_ranks_equals_one_process(tmp_path, corpus_dir, moe_single):
    run_dir = tmp_path / "fsdp"
    train_on(2, layout_sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp", **MOE))
    assert_same_training(run_dir, moe_single)
    bias = weights(run_dir)["blocks.1.mlp.expert_bias"]
    assert bias.abs().max() > 0 and torch.equal(bias, weights(moe_single)["blocks.1.mlp.expert_bias"])
