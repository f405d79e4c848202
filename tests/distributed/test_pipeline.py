"""Pipeline parallelism through the real launcher (gloo processes on the CPU): every schedule,
and pipelines combined with data and tensor parallelism, train as one process does; their
checkpoints resume in other layouts; bad layouts are refused before the first step.

The reference process accumulates micro-batches of the size of a pipeline's pieces, so both sum
the same partial gradients, and the weights agree to rounding (see test_parallel.py)."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError, ParallelConfig
from kiln.distributed.pipeline import _cut, _keep, stage_layers
from kiln.distributed.world import mesh_shape
from kiln.models.gpt import FAMILY, GPTConfig

from conftest import tiny_overrides
from kilnrun import in_process, records
from layouts import STEPS, assert_same_training, layout_sets, resumable_copy, started, train_on, weights

# Four layers (two stages of two, or four of one), untied: the embedding and the output layer
# live on different stages.
PIPE_MODEL = dict(model__n_layer=4, model__tie_embeddings="false")


def _pipe_sets(run_dir: Path, corpus: Path, micro: int, **extra) -> list[str]:
    return layout_sets(run_dir, corpus, micro, **{**PIPE_MODEL, **extra})


@pytest.fixture(scope="module")
def single_by(tmp_path_factory, corpus_dir):
    """One process accumulating micro-batches of ``micro`` sequences, the embeddings tied or
    not, made once per kind (in this process)."""
    runs: dict[tuple[int, str], Path] = {}

    def get(micro: int, tie: str = "false") -> Path:
        if (micro, tie) not in runs:
            runs[micro, tie] = tmp_path_factory.mktemp(f"single{micro}{tie}") / "run"
            in_process("train", *_pipe_sets(runs[micro, tie], corpus_dir, micro, model__tie_embeddings=tie))
        return runs[micro, tie]

    return get


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, corpus_dir) -> Path:
    """Two stages (1f1b), micro-batches of 4 with accumulation 2, each cut into 2 pieces."""
    run_dir = tmp_path_factory.mktemp("pipelined") / "run"
    train_on(2, _pipe_sets(run_dir, corpus_dir, micro=4, parallel__pp=2))
    return run_dir


@pytest.mark.parametrize(
    "schedule, extra, piece",
    [
        ("gpipe", {}, 2),
        # Two virtual stages per rank: four stages, so at least four pieces.
        ("interleaved_1f1b", {"parallel__pp_virtual_stages": 2}, 1),
    ],
)
@pytest.mark.slow
def test_two_stages_train_as_one_process(tmp_path, corpus_dir, single_by, schedule, extra, piece):
    run_dir = tmp_path / "pp"
    # Micro-batches of 4 with accumulation 2; each cut into 4 / piece pipeline micro-batches.
    train_on(2, _pipe_sets(run_dir, corpus_dir, micro=4, parallel__pp=2, parallel__pp_schedule=schedule, **extra))
    assert_same_training(run_dir, single_by(piece))


def test_two_stages_on_1f1b_train_as_one_process(pipelined, single_by):
    assert_same_training(pipelined, single_by(2))


@pytest.mark.slow
def test_packed_documents_in_two_stages_train_as_one_process(tmp_path, short_documents):
    """Every stage keeps the attention of each row's documents apart, from their positions."""
    one, pp = tmp_path / "one", tmp_path / "pp"
    in_process("train", *_pipe_sets(one, short_documents, micro=2, data__document_mask=True))
    train_on(2, _pipe_sets(pp, short_documents, micro=4, parallel__pp=2, data__document_mask=True))
    assert_same_training(pp, one)


@pytest.mark.slow
def test_fp16_in_two_stages_trains_as_one_process(tmp_path, corpus_dir):
    """One loss scale for every stage (the last stage's scaled loss is what every stage's
    gradients carry), decided from the global gradient norm."""
    one, pp = tmp_path / "one", tmp_path / "pp"
    in_process("train", *_pipe_sets(one, corpus_dir, micro=2, train__precision="fp16"))
    train_on(2, _pipe_sets(pp, corpus_dir, micro=4, parallel__pp=2, train__precision="fp16"))
    # Gradients in fp16 round where the stages' sums fall differently: on an AVX2 machine a few
    # rarely seen embedding rows, whose tiny gradients Adam scales up, end 1e-3 apart (lr: 1e-2).
    assert_same_training(pp, one, atol=3e-3)
    scales = {r["loss_scale"] for run in (one, pp) for r in records(run) if "loss_scale" in r}
    assert scales == {2.0**16}


@pytest.mark.slow
def test_tied_embeddings_are_pipelined(tmp_path, corpus_dir, single_by):
    """The first and the last stage each hold a copy of the tied matrix; their gradients are
    summed, so the copies stay equal and train as the one matrix of a single process."""
    run_dir = tmp_path / "pp"
    train_on(2, _pipe_sets(run_dir, corpus_dir, micro=4, parallel__pp=2, model__tie_embeddings="true"))
    assert_same_training(run_dir, single_by(2, "true"))
    trained = weights(run_dir)
    assert torch.equal(trained["tok_emb.weight"], trained["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, micro, extra",
    [
        ("ddp", 2, {}),
        ("fsdp", 2, {}),
        # Two stages per rank, each one an FSDP root of its own; four stages, four pieces.
        ("fsdp", 4, {"parallel__pp_schedule": "interleaved_1f1b", "parallel__pp_virtual_stages": 2}),
    ],
)
def test_pipeline_times_data_parallel_on_four_ranks(tmp_path, corpus_dir, single_by, strategy, micro, extra):
    run_dir = tmp_path / "ppdp"
    train_on(4, _pipe_sets(run_dir, corpus_dir, micro=micro, parallel__pp=2, parallel__strategy=strategy, **extra))
    assert_same_training(run_dir, single_by(1))


@pytest.mark.slow
def test_pipeline_times_tensor_parallel_on_four_ranks(tmp_path, corpus_dir, single_by):
    run_dir = tmp_path / "pptp"
    train_on(4, _pipe_sets(run_dir, corpus_dir, micro=4, parallel__pp=2, parallel__tp=2))
    # Tensor parallelism adds its all-reduce's rounding to the pipeline's; Adam magnifies it in
    # the embedding rows of rare tokens (whose gradients are near zero) to about 1e-4.
    assert_same_training(run_dir, single_by(2), atol=3e-4)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["single", "dp2"])
def test_a_pipeline_checkpoint_resumes_in_another_layout(tmp_path, corpus_dir, pipelined, single_by, then):
    run_dir = resumable_copy(pipelined, tmp_path / "run", 3)
    if then == "single":
        proc = in_process("train", *_pipe_sets(run_dir, corpus_dir, micro=2))
    else:
        proc = train_on(2, _pipe_sets(run_dir, corpus_dir, micro=2))
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert_same_training(run_dir, single_by(2), steps=range(4, STEPS + 1))
    # The one-process tools read the pipeline's checkpoint too.
    assert "val_loss" in in_process("eval", pipelined).stdout


@pytest.mark.slow
@pytest.mark.parametrize("tie", ["false", "true"])
def test_a_whole_model_checkpoint_resumes_as_a_pipeline(tmp_path, corpus_dir, single_by, tie):
    """Each stage takes its layers of a one-process checkpoint (and a tied matrix's optimizer
    state, kept there under the embedding's name, for the output layer's copy)."""
    ref = single_by(2, tie)
    run_dir = resumable_copy(ref, tmp_path / "run", 3)
    proc = train_on(2, _pipe_sets(run_dir, corpus_dir, micro=4, parallel__pp=2, model__tie_embeddings=tie))
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert_same_training(run_dir, ref, steps=range(4, STEPS + 1))


@pytest.mark.slow
def test_a_killed_pipeline_resumes_bitwise(tmp_path, corpus_dir):
    steps = 60

    def sets(run_dir):
        items = tiny_overrides(
            run_dir, corpus_dir, **PIPE_MODEL, parallel__pp=2, train__max_steps=steps, checkpoint__every=10
        )
        return [a for item in items for a in ("--set", item)]

    ref = tmp_path / "uninterrupted"
    train_on(2, sets(ref))
    run_dir = tmp_path / "killed"
    launcher, ranks = started(["launch", "--nproc-per-node", "2", "--", "train", *sets(run_dir)], run_dir, steps)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    proc = train_on(2, sets(run_dir))
    assert "resumed from" in proc.stdout
    for (name, a), b in zip(weights(run_dir).items(), weights(ref).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_invalid_pipeline_layouts_are_refused_before_the_first_step():
    """Each rank refuses them while it sets up, before the run directory is touched (a refused
    launch is tested end to end in test_parallel.py: test_rank_errors_name_the_rank)."""
    from kiln.config import Config, TrainConfig

    train = TrainConfig(micro_batch_size=4, global_batch_size=8)
    errors = Config(parallel=ParallelConfig(pp=2, pp_microbatches=1), train=train).errors()
    assert "parallel.pp_microbatches: 1 is fewer than the pipeline's 2 stages" in "\n".join(errors)
    with pytest.raises(ConfigError, match="layers do not split into 2 equal pipeline stages"):
        stage_layers(3, 2)
    with pytest.raises(ConfigError, match="the world size 3 is not a multiple of parallel.pp x parallel.tp = 2 x 1"):
        mesh_shape(3, pp=2, tp=1)
    assert mesh_shape(8, pp=2, tp=2) == (2, 2, 2)


def test_config_refuses_pipelines_that_cannot_work():
    from kiln.config import Config, TrainConfig

    def errors(**parallel):
        train = TrainConfig(micro_batch_size=4, global_batch_size=8)
        return "\n".join(Config(parallel=ParallelConfig(**parallel), train=train).errors())

    assert "interleaved_1f1b needs parallel.pp_virtual_stages >= 2" in errors(pp=2, pp_schedule="interleaved_1f1b")
    assert "need parallel.pp_schedule=interleaved_1f1b" in errors(pp=2, pp_virtual_stages=2)
    assert "3 pipeline micro-batches, which must divide it" in errors(pp=2, pp_microbatches=3)
    assert errors(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2) == ""
    assert ParallelConfig(pp=2, pp_virtual_stages=2, pp_schedule="interleaved_1f1b").microbatches == 4
    assert "parallel.pp_layers: [1, 2, 1] must give each of the pipeline's 2 stages" in errors(
        pp=2, pp_layers=(1, 2, 1)
    )
    assert "parallel.pp_layers: [0, 4] must give each" in errors(pp=2, pp_layers=(0, 4))


def test_stages_of_given_sizes_take_consecutive_layers():
    assert stage_layers(126, 8, (15, 16, 16, 16, 16, 16, 16, 15))[0] == range(0, 15)
    assert stage_layers(126, 8, (15, 16, 16, 16, 16, 16, 16, 15))[-1] == range(111, 126)
    assert stage_layers(3, 2, (1, 2)) == [range(0, 1), range(1, 3)]
    with pytest.raises(ConfigError, match=r"parallel.pp_layers: \[1, 1\] add up to 2 layers; the model has 3"):
        stage_layers(3, 2, (1, 1))


@pytest.mark.slow
def test_stages_of_unequal_layers_train_as_one_process(tmp_path, corpus_dir, single_by):
    """One layer on the first stage (beside the embedding), three on the last."""
    run_dir = tmp_path / "pp"
    train_on(2, _pipe_sets(run_dir, corpus_dir, micro=4, parallel__pp=2, parallel__pp_layers="1,3"))
    assert_same_training(run_dir, single_by(2))
    assert sorted(k for k in weights(run_dir) if k.endswith("attn.wq.weight")) == [
        f"blocks.{i}.attn.wq.weight" for i in range(4)
    ]


def test_stages_compose_to_the_whole_model():
    """Stages cut from copies of the model, run one after the other, compute what the whole model
    does and keep its parameter names; a rank's stages cut from its part share its layers."""
    args = GPTConfig(
        vocab_size=64, n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=16, tie_embeddings=False
    )
    torch.manual_seed(0)
    model = FAMILY.build(args)
    plan = FAMILY.parallel_plan(args)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    layers = stage_layers(4, 2)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    _keep(first, plan, layers[0], True, False)
    _keep(last, plan, layers[1], False, True)
    torch.testing.assert_close(last(first(x), targets=y), model(x, y), rtol=0, atol=0)
    names = set(model.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == names
    assert "blocks.3.mlp.w2.weight" in last.state_dict() and "tok_emb.weight" not in last.state_dict()
    # A cut (a rank's part of the model, or one of the part's stages): the same modules, fewer
    # of them; what it is cut from keeps all of its (the initial values are read from the model).
    part = copy.deepcopy(model)
    head = _cut(part, plan, layers[0], True, False)
    assert head.blocks["1"] is part.blocks[1] and head.tok_emb is part.tok_emb and "2" not in head.blocks
    assert len(part.blocks) == 4 and part.norm is not None
    torch.testing.assert_close(head(x), first(x), rtol=0, atol=0)
