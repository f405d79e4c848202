"""A mixture of experts laid out over gloo ranks trains as one process does: the experts'
balancing bias moves by the load of every rank's tokens, the same everywhere, and experts split
over ranks (``parallel.ep``) exchange tokens without changing a result."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.train.run import load_run

from kilnrun import in_process
from layouts import STEPS, assert_same_training, layout_sets, resumable_copy, train_on, weights

pytestmark = pytest.mark.dist

# A bias rate high enough to change which experts tokens pick within the run's six steps.
MOE = dict(model__preset="tiny-moe", model__n_layer=2, model__router_bias_rate=0.05)
EP = dict(parallel__strategy="fsdp", parallel__ep=2, **MOE)


@pytest.fixture(scope="module")
def moe_single(tmp_path_factory, corpus_dir):
    run_dir = tmp_path_factory.mktemp("moe") / "one"
    in_process("train", *layout_sets(run_dir, corpus_dir, micro=4, **MOE))
    return run_dir


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, corpus_dir):
    """Two ranks, each holding half of every layer's experts."""
    run_dir = tmp_path_factory.mktemp("moe") / "ep2"
    train_on(2, layout_sets(run_dir, corpus_dir, micro=2, **EP))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp", "hsdp"])
def test_a_mixture_of_experts_on_two_fsdp_ranks_equals_one_process(tmp_path, corpus_dir, moe_single, replicas):
    """Two FSDP ranks, or HSDP's two replicas of them (4 ranks)."""
    run_dir = tmp_path / "fsdp"
    layout = dict(parallel__strategy="fsdp", parallel__dp_replicate=replicas)
    train_on(2 * replicas, layout_sets(run_dir, corpus_dir, micro=2, **layout, **MOE))
    assert_same_training(run_dir, moe_single)
    bias = weights(run_dir)["blocks.1.mlp.expert_bias"]
    assert bias.abs().max() > 0 and torch.equal(bias, weights(moe_single)["blocks.1.mlp.expert_bias"])


@pytest.mark.slow
def test_experts_split_over_two_ranks_train_as_one_process(ep_run, moe_single):
    assert_same_training(ep_run, moe_single)


@pytest.mark.slow
def test_experts_split_over_two_ranks_and_sharded_over_two_more_train_as_one_process(tmp_path, corpus_dir, moe_single):
    run_dir = tmp_path / "ep2x4"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=1, **EP))
    assert_same_training(run_dir, moe_single)


@pytest.mark.slow
def test_experts_split_over_the_context_parallel_ranks_train_as_one_process(tmp_path, corpus_dir, moe_single):
    """4 ranks: 2 batches, each sequence over 2 context-parallel ranks, which split the experts too."""
    run_dir = tmp_path / "cp2ep2"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=2, parallel__cp=2, **EP))
    assert_same_training(run_dir, moe_single)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_exports_one_layer_at_a_time_with_transformers_logits(ep_run, tmp_path):
    """The streamed export of a sharded run checks its logits on a cut of the model that
    transformers loads itself (its experts fused from the files' one tensor each)."""
    import transformers

    out = tmp_path / "hf"
    in_process("export", ep_run, "--format", "hf", "--out", out)
    info = json.loads((out / "export.json").read_text())
    assert info["streamed"] and info["check"]["layers"] == [0, 1]
    assert info["hf"]["max_abs_diff"] <= 1e-4
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(loading.values()), loading
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        expected = load_run(ep_run, device="cpu").model(ids)
        torch.testing.assert_close(model.eval()(ids).logits, expected, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_in_one_process_and_back(tmp_path, corpus_dir, ep_run, moe_single):
    one = resumable_copy(ep_run, tmp_path / "to-one", 3)
    proc = in_process("train", *layout_sets(one, corpus_dir, micro=4, **MOE))
    assert "at step 3" in proc.stdout
    assert_same_training(one, moe_single, steps=range(4, STEPS + 1))
    split = resumable_copy(moe_single, tmp_path / "to-ep", 3)
    proc = train_on(2, layout_sets(split, corpus_dir, micro=2, **EP))
    assert "at step 3" in proc.stdout
    assert_same_training(split, moe_single, steps=range(4, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sets", "messages"),
    [
        # Each rank reports every error of its layout at once: two faults, one launch.
        (
            dict(parallel__ep=3, **MOE),
            [
                "parallel.ep: experts split over ranks need parallel.strategy fsdp",
                "parallel.ep: 3 must divide the data-parallel",
            ],
        ),
        (dict(parallel__ep=2, parallel__strategy="fsdp"), ["parallel.ep: the model has no experts to split"]),
    ],
)
def test_expert_parallel_layouts_it_cannot_take_are_named(tmp_path, corpus_dir, sets, messages):
    proc = train_on(2, layout_sets(tmp_path / "run", corpus_dir, micro=2, **sets), check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    for message in messages:
        assert message in proc.stderr, proc.stderr[-2000:]


def test_one_process_cannot_split_experts(tmp_path, corpus_dir):
    proc = in_process("train", *layout_sets(tmp_path / "run", corpus_dir, micro=4, parallel__ep=2, **MOE), check=False)
    assert proc.returncode == 2
    assert "parallel.ep: 2 must divide the data-parallel ranks, 1" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_experts_split_over_two_ranks_in_each_pipeline_stage_train_as_one_process(tmp_path, corpus_dir, moe_single):
    """4 ranks: 2 stages, each with its layers' experts over 2 ranks. The stages learn their
    shapes from a forward pass of their own, which must not count in the experts' load."""
    run_dir = tmp_path / "ep2pp2"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=4, parallel__pp=2, **EP))
    assert_same_training(run_dir, moe_single)


def test_pipeline_stages_still_learn_their_shapes_where_kiln_turns_training_mode_off():
    from torch.distributed.pipelining import PipelineStage

    assert callable(getattr(PipelineStage, "_forward_metadata_inference", None)), (
        "PyTorch renamed PipelineStage._forward_metadata_inference: update kiln.distributed.pipeline._stage_class"
    )


@pytest.mark.slow
def test_experts_split_over_ranks_beside_tensor_parallel_attention(tmp_path, corpus_dir, moe_single):
    """4 ranks: attention split over 2 tensor-parallel ranks, experts over the 2 data-parallel ones."""
    run_dir = tmp_path / "ep2tp2"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=2, parallel__tp=2, **EP))
    assert_same_training(run_dir, moe_single)
