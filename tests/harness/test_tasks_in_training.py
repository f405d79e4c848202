"""Benchmark tasks scored during training (eval.tasks): the scores at the asked steps, and the
run itself unchanged by them."""

from __future__ import annotations

import json

import pytest
import torch
from tasksets import write_tasks

from conftest import tiny_overrides
from kilnrun import in_process, records, sets
from layouts import train_on

pytest.importorskip("lm_eval")


def train(run_dir, corpus_dir, *extra: str) -> None:
    items = tiny_overrides(run_dir, corpus_dir, data__seq_len=64, train__max_steps=10, eval__every=5)
    in_process("train", *sets([*items, *extra]))


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from kiln.train.run import load_run

    return load_run(run_dir, device="cpu").model.state_dict()


@pytest.mark.slow
def test_task_scores_are_logged_and_change_nothing_of_the_run(tmp_path, corpus_dir):
    tasks = write_tasks(tmp_path / "tasks")
    scored, plain = tmp_path / "scored", tmp_path / "plain"
    asked = ["eval.tasks=kiln_mc,kiln_gen", "eval.tasks_every=4", f"eval.tasks_include={tasks}", "eval.tasks_limit=6"]
    train(scored, corpus_dir, *asked)
    train(plain, corpus_dir)
    losses = [{r["step"]: r["loss"] for r in records(run) if "loss" in r} for run in (scored, plain)]
    assert losses[0] == losses[1] and len(losses[0]) == 10  # bitwise: the same floats
    vals = [[r["val_loss"] for r in records(run) if "val_loss" in r] for run in (scored, plain)]
    assert vals[0] == vals[1]
    got, want = final_weights(scored), final_weights(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
    scores = [r for r in records(scored) if any(k.startswith("tasks/") for k in r)]
    assert [r["step"] for r in scores] == [4, 8, 10]  # every 4 steps and at the end
    for r in scores:
        assert {"tasks/kiln_mc/acc", "tasks/kiln_mc/acc_norm", "tasks/kiln_gen/exact_match"} <= set(r)
        assert 0 <= r["tasks/kiln_mc/acc"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"parallel__strategy": "fsdp"},
        {"parallel__cp": 2},
        {"parallel__tp": 2},
        {"parallel__pp": 2},
        {"parallel__strategy": "fsdp", "parallel__dp_replicate": 2, "train__micro_batch_size": 2},
        {"parallel__strategy": "fsdp", "parallel__tp": 2, "parallel__cp": 2},
    ],
    ids=["fsdp", "cp", "tp", "pp", "hsdp", "tp-cp"],
)
def test_task_scores_on_two_ranks_are_those_of_the_saved_model(tmp_path, corpus_dir, layout):
    """Two FSDP ranks score the tasks through the sharded model, two context-parallel ranks
    through the model that splits each row (padded to whole chunks) and decodes whole on each,
    two tensor-parallel ranks through rows padded to whole shares of positions (their logits
    gathered from the ranks' shares of the vocabulary), two pipeline stages through the stages
    in turn (the last one's logits sent to the other); the scores at the end are those ``kiln
    eval --tasks`` gives the run's last checkpoint, and the generation task's too, decoded on
    tensor-parallel ranks in forward passes padded to whole shares of positions, in pipeline
    stages by running the stages in turn at each step. HSDP: two replicas of two FSDP ranks;
    tp-cp: two pairs of tensor-parallel ranks splitting rows over two context-parallel ranks
    (4 ranks each)."""
    tasks = write_tasks(tmp_path / "tasks")
    run = tmp_path / "run"
    asked = "kiln_mc,kiln_gen"
    items = tiny_overrides(run, corpus_dir, data__seq_len=64, train__max_steps=6, eval__sample_tokens=0, **layout)
    items += [f"eval.tasks={asked}", f"eval.tasks_include={tasks}", "eval.tasks_limit=8"]
    four = "parallel__dp_replicate" in layout or {"parallel__tp", "parallel__cp"} <= layout.keys()
    train_on(4 if four else 2, sets(items))
    [logged] = [r for r in records(run) if "tasks/kiln_mc/acc" in r]
    assert logged["step"] == 6
    in_process("eval", run, "--tasks", asked, "--include-path", tasks, "--limit", "8")
    saved = json.loads((run / "eval" / "kiln_mc.json").read_text())["results"]["kiln_mc"]
    assert logged["tasks/kiln_mc/acc"] == saved["acc,none"]
    assert logged["tasks/kiln_mc/acc_norm"] == saved["acc_norm,none"]
    generated = json.loads((run / "eval" / "kiln_gen.json").read_text())["results"]["kiln_gen"]
    assert logged["tasks/kiln_gen/exact_match"] == generated["exact_match,none"]


def test_an_unknown_task_stops_the_run_before_it_trains(tmp_path, corpus_dir):
    run = tmp_path / "run"
    proc = in_process("train", *sets(tiny_overrides(run, corpus_dir, eval__tasks="no_such_task")), check=False)
    assert proc.returncode == 2 and "task 'no_such_task': no such task" in proc.stderr
    assert not (run / "checkpoints").exists()
