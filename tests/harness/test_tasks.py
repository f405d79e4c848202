"""Benchmark tasks through lm-evaluation-harness: kiln's model scores them as lm-eval's own hf
model scores the run's Hugging Face export, its rolling log-likelihood is ``kiln eval --data``,
and ``kiln eval --tasks`` writes lm-eval's results (or a one-line error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tasksets import write_tasks

from conftest import tiny_overrides
from kilnrun import in_process, sets

lm_eval = pytest.importorskip("lm_eval")

SEQ_LEN = 64


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir) -> tuple[Path, Path, Path]:
    """A tiny run trained on Python sources, its Hugging Face export and the tasks' directory."""
    base = tmp_path_factory.mktemp("harness")
    run = base / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, data__seq_len=SEQ_LEN, train__max_steps=20)))
    in_process("export", run, "--format", "hf", "--out", base / "export")
    return run, base / "export", write_tasks(base / "tasks")


def kiln_results(run: Path, tasks: Path, names: list[str]) -> dict:
    from kiln.harness import check_tasks, run_tasks, task_manager
    from kiln.harness.model import KilnLM
    from kiln.train.run import load_run

    manager = task_manager(tasks, names)
    check_tasks(names, manager)
    saved = load_run(run, device="cpu")
    lm = KilnLM(saved.model, saved.family, saved.tokenizer, SEQ_LEN, batch_size=4)
    results = run_tasks(lm, names, manager, log_samples=True, bootstrap_iters=0)
    assert results is not None
    return results


def test_generation_requests_of_any_lengths_answer_batched_as_one_at_a_time(trained):
    from lm_eval.api.instance import Instance

    from kiln.harness.model import KilnLM
    from kiln.train.run import load_run

    saved = load_run(trained[0], device="cpu")
    contexts = ["def ", "import os\nimport sys\n\ndef main(", "class A:\n    def __init__(self", "x = [", "# a"]
    kwargs = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    requests = [Instance("generate_until", {}, (c, kwargs), i) for i, c in enumerate(contexts * 2)]

    def answers(batch_size: int) -> list[str]:
        lm = KilnLM(saved.model, saved.family, saved.tokenizer, SEQ_LEN, batch_size=batch_size)
        return lm.generate_until(requests)

    one = answers(1)
    assert len({len(KilnLM(saved.model, saved.family, saved.tokenizer, SEQ_LEN).tok_encode(c)) for c in contexts}) >= 4
    assert answers(8) == one and answers(3) == one

    # Sampled: seeded from torch's generator (lm-eval seeds it), so the same whatever the batch,
    # and the same on every rank of a sharded model.
    kwargs.update(do_sample=True, temperature=1.5)
    torch.manual_seed(1234)
    sampled = answers(8)
    torch.manual_seed(1234)
    assert answers(3) == sampled and sampled != one


@pytest.mark.slow
def test_kiln_scores_tasks_as_lm_eval_scores_the_hf_export(trained):
    run, export, tasks = trained
    from kiln.harness import task_manager

    ours = kiln_results(run, tasks, ["kiln_mc", "kiln_gen"])
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32,device=cpu",
        tasks=["kiln_mc", "kiln_gen"],
        task_manager=task_manager(tasks),
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )
    for task in ("kiln_mc", "kiln_gen"):
        assert ours["results"][task] == theirs["results"][task]
    mine, hf = ours["samples"]["kiln_mc"], theirs["samples"]["kiln_mc"]
    assert len(mine) == len(hf) == 20
    for a, b in zip(mine, hf, strict=True):
        got = [r[0] for r in a["resps"]]
        want = [r[0] for r in b["resps"]]
        assert [g for _, g in got] == [g for _, g in want]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)
    assert [s["resps"] for s in ours["samples"]["kiln_gen"]] == [s["resps"] for s in theirs["samples"]["kiln_gen"]]


@pytest.mark.slow
def test_rolling_log_likelihood_is_kiln_eval_data(trained):
    """lm-eval's bits per byte of a perplexity task equals ``kiln eval --data`` on its file."""
    run, _, tasks = trained
    bpb = kiln_results(run, tasks, ["kiln_ppl"])["results"]["kiln_ppl"]["bits_per_byte,none"]
    ours = json.loads(in_process("eval", run, "--data", tasks / "ppl.jsonl", "--batch-size", "3").stdout)
    assert ours["val_bpb"] == pytest.approx(bpb, abs=1e-4)


def test_kiln_eval_tasks_writes_lm_eval_results(trained):
    run, _, tasks = trained
    out = in_process("eval", run, "--tasks", "kiln_mc,kiln_ppl", "--include-path", tasks, "--limit", "5")
    assert "kiln_mc" in out.stdout and "acc" in out.stdout
    written = json.loads((run / "eval" / "kiln_mc.json").read_text())
    assert written["results"]["kiln_mc"]["acc,none"] >= 0 and written["n-samples"]["kiln_mc"]["effective"] == 5
    assert "bits_per_byte,none" in json.loads((run / "eval" / "kiln_ppl.json").read_text())["results"]["kiln_ppl"]


def test_the_tasks_of_an_include_path_are_found_without_indexing_lm_evals_own(tmp_path):
    """lm-eval's own registry (thousands of files, seconds to index) is read only for a task the
    include path does not hold (``test_bad_tasks_are_one_line_errors``: its count in the error)."""
    from kiln.harness import task_manager

    tasks = write_tasks(tmp_path / "tasks")
    own = task_manager(tasks, ["kiln_mc"])
    assert "kiln_mc" in own.all_tasks and "hellaswag" not in own.all_tasks
    # Indexed once a process while the files stay the same; a task file added is indexed.
    assert task_manager(tasks, ["kiln_mc"]) is own
    (tasks / "more.yaml").write_text((tasks / "mc.yaml").read_text().replace("kiln_mc", "kiln_more"))
    again = task_manager(tasks, ["kiln_mc", "kiln_more"])
    assert again is not own and {"kiln_mc", "kiln_more"} <= set(again.all_tasks)


@pytest.mark.slow
def test_bad_tasks_are_one_line_errors(trained, tmp_path):
    run, _, tasks = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    yaml = (tasks / "mc.yaml").read_text().replace("kiln_mc", "kiln_broken")
    (broken / "broken.yaml").write_text(yaml.replace(str(tasks / "mc.jsonl"), str(broken / "gone.jsonl")))
    for args, fragments in [
        (["--tasks", "no_such_task", "--include-path", tasks], ["task 'no_such_task': no such task"]),
        (["--tasks", "kiln_mc", "--include-path", empty], [f"--include-path {empty}: no task YAML files"]),
        (["--tasks", "kiln_broken", "--include-path", broken], ["task 'kiln_broken': its data cannot be read", "gone"]),
    ]:
        proc = in_process("eval", run, *args, check=False)
        assert proc.returncode == 2 and all(f in proc.stderr for f in fragments), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_hugging_face_lora_run_unmerged_scores_as_its_merged_export(tmp_path, hf_llama):
    """A LoRA fine-tune of a Hugging Face Llama, scored with its adapters in place, gives what
    lm-eval's hf model gives on its export (the adapters folded in)."""
    from kiln.harness import run_tasks, task_manager
    from kiln.harness.model import KilnLM
    from kiln.train.run import load_run

    from conftest import sft_records, write_jsonl

    sft = write_jsonl(tmp_path / "sft.jsonl", sft_records(32))
    run, export, tasks = tmp_path / "run", tmp_path / "export", write_tasks(tmp_path / "tasks")
    items = {
        "run.dir": run,
        "model.source": f"hf:{hf_llama}",
        "data.source": sft,
        "data.seq_len": 64,
        "train.max_steps": 4,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "eval.every": 0,
        "lora.rank": 4,
        "lora.alpha": 8,
        "lora.dropout": 0.0,
    }
    in_process("train", *sets([f"{k}={v}" for k, v in items.items()]))
    in_process("export", run, "--format", "hf", "--out", export)
    saved = load_run(run, device="cpu")
    assert any("lora_" in name for name in saved.model.state_dict())  # scored unmerged
    manager = task_manager(tasks, ["kiln_mc"])
    lm = KilnLM(saved.model, saved.family, saved.tokenizer, saved.family.context_length(saved.args) or 64)
    ours = run_tasks(lm, ["kiln_mc"], manager, log_samples=True, bootstrap_iters=0)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32,device=cpu",
        tasks=["kiln_mc"],
        task_manager=manager,
        batch_size=8,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert ours is not None and ours["results"]["kiln_mc"]["acc,none"] == theirs["results"]["kiln_mc"]["acc,none"]
    for a, b in zip(ours["samples"]["kiln_mc"], theirs["samples"]["kiln_mc"], strict=True):
        assert [r[0][0] for r in a["resps"]] == pytest.approx([r[0][0] for r in b["resps"]], abs=1e-4)
