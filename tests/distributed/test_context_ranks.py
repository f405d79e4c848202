"""Sequences split over gloo ranks (``parallel.cp``) train as one process does, alone and with
FSDP and tensor parallelism beside them, at a length where the split matters (256 tokens)."""

from __future__ import annotations

import pytest

from kilnrun import in_process, losses, records
from layouts import assert_same_training, layout_sets, train_on

pytestmark = pytest.mark.dist

LONG = dict(data__seq_len=256, eval__every=3)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus_dir):
    run_dir = tmp_path_factory.mktemp("cp") / "one"
    in_process("train", *layout_sets(run_dir, corpus_dir, micro=2, **LONG))
    return run_dir


def val_losses(run_dir) -> list[float]:
    return [r["val_loss"] for r in records(run_dir) if "val_loss" in r]


@pytest.mark.slow
def test_two_ranks_splitting_each_sequence_train_as_one_process(tmp_path, corpus_dir, one_process):
    run_dir = tmp_path / "cp2"
    train_on(2, layout_sets(run_dir, corpus_dir, micro=2, parallel__cp=2, **LONG))
    assert_same_training(run_dir, one_process)
    assert val_losses(run_dir) == pytest.approx(val_losses(one_process), rel=1e-5)


@pytest.mark.slow
def test_sequences_split_over_two_ranks_and_sharded_over_four_train_as_one_process(tmp_path, corpus_dir, one_process):
    run_dir = tmp_path / "cp2x4"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=2, parallel__cp=2, parallel__strategy="fsdp", **LONG))
    assert_same_training(run_dir, one_process)
    assert val_losses(run_dir) == pytest.approx(val_losses(one_process), rel=1e-5)


@pytest.mark.slow
def test_sequences_split_over_two_ranks_with_tensor_parallel_pairs_train_as_one_process(
    tmp_path, corpus_dir, one_process
):
    run_dir = tmp_path / "cp2tp2"
    sets = layout_sets(run_dir, corpus_dir, micro=2, parallel__cp=2, parallel__tp=2, parallel__strategy="fsdp", **LONG)
    train_on(4, sets)
    assert_same_training(run_dir, one_process)


@pytest.mark.slow
def test_sequences_split_over_two_ranks_in_two_pipeline_stages_train_as_one_process(tmp_path, corpus_dir, one_process):
    """Each stage takes and passes on its rank's chunks; past the first, a stage learns the
    sequences' length from the targets every stage takes."""
    run_dir = tmp_path / "cp2pp2"
    train_on(4, layout_sets(run_dir, corpus_dir, micro=2, parallel__cp=2, parallel__pp=2, **LONG))
    assert_same_training(run_dir, one_process)
    assert val_losses(run_dir) == pytest.approx(val_losses(one_process), rel=1e-5)


@pytest.mark.slow
def test_packed_documents_split_over_two_ranks_and_into_pipeline_stages_train_as_one_process(tmp_path, short_documents):
    masked = dict(LONG, data__document_mask=True)
    one, plain, cp = tmp_path / "one", tmp_path / "plain", tmp_path / "cp2"
    in_process("train", *layout_sets(one, short_documents, micro=2, **masked))
    in_process("train", *layout_sets(plain, short_documents, micro=2, train__max_steps=1, **LONG))
    train_on(2, layout_sets(cp, short_documents, micro=2, parallel__cp=2, **masked))
    # In pipeline stages too: every stage cuts the documents' positions it takes as the tokens.
    train_on(
        4, layout_sets(cp_pp := tmp_path / "cp2pp2", short_documents, micro=2, parallel__cp=2, parallel__pp=2, **masked)
    )
    # And HSDP's two replicas of two shards.
    train_on(
        4,
        layout_sets(
            hsdp := tmp_path / "hsdp",
            short_documents,
            micro=2,
            parallel__strategy="fsdp",
            parallel__dp_replicate=2,
            **masked,
        ),
    )
    for run_dir in (cp, cp_pp, hsdp):
        assert_same_training(run_dir, one)
        assert val_losses(run_dir) == pytest.approx(val_losses(one), rel=1e-5)
    # The mask is in force: the first step's loss is not the unmasked run's.
    assert abs(losses(one)[1] - losses(plain)[1]) > 1e-5


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (dict(parallel__cp=2), "parallel.cp: 2 must divide the data-parallel ranks, 1"),
        (dict(parallel__cp=3, data__seq_len=32), "parallel.cp: each sequence is cut into 2 x parallel.cp = 6 equal"),
        (dict(parallel__cp=2, parallel__ep=3), "parallel.ep: with parallel.cp = 2 the experts are split over"),
        (dict(parallel__cp=2, train__micro_batch_size="auto"), "train.micro_batch_size: auto is not probed under"),
    ],
)
def test_layouts_context_parallelism_cannot_take_are_named_before_training(tmp_path, corpus_dir, sets, message):
    proc = in_process("train", *layout_sets(tmp_path / "run", corpus_dir, micro=4, **sets), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_model_whose_plan_names_no_attention_cannot_split_its_sequences():
    from kiln.config import ConfigError, ParallelConfig
    from kiln.distributed.parallelize import check_layout
    from kiln.distributed.world import World
    from kiln.models.family import ParallelPlan

    with pytest.raises(ConfigError, match="parallel.cp: MixerLM cannot split its sequences"):
        check_layout(ParallelPlan(), World(size=2), ParallelConfig(cp=2), "MixerLM")
