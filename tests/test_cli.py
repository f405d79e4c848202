"""The command line as a user runs it: exit codes, output, files in the run directory; in subprocesses
where the process itself is the subject (signals, a fresh interpreter), by kiln's main() in this process
elsewhere."""

import gc
import json
import signal
import sys
import time

import pytest

from kiln.cli import command

from conftest import tiny_overrides
from kilnrun import assert_equal, checkpoint, in_process, kiln, losses, sets, start

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=0.1", "train.lrr: unknown config key; did you mean train.lr?"),
        ("train.max_steps=1.5", "train.max_steps: expected an integer"),
        ("train.global_batch_size=10", "train.global_batch_size: 10 is not a multiple of train.micro_batch_size"),
        ("train.precision=fp64", "train.precision: 'fp64' is not allowed; choose one of auto, fp32, bf16, fp16"),
    ],
)
def test_bad_config_exits_2_and_writes_nothing(tmp_path, monkeypatch, override, message):
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # nothing is written here either
    proc = in_process("train", "--set", f"run.dir={run_dir}", "--set", override, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_command_leaves_its_heap_to_the_exit(monkeypatch, capsys):
    """The kiln command freezes the collector's objects once its work is done, so that the
    interpreter's exit does not walk torch's whole heap (seconds per process, each rank's too)."""
    gc.unfreeze()
    monkeypatch.setattr(sys, "argv", ["kiln", "config", "--reference"])
    try:
        assert command() == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert "train.max_steps" in capsys.readouterr().out


def test_bad_data_path_exits_2(tmp_path):
    proc = kiln(
        "train", "--set", f"run.dir={tmp_path / 'run'}", "--set", f"data.source={tmp_path / 'nope.txt'}", check=False
    )
    assert proc.returncode == 2 and "nope.txt" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, corpus_dir):
    """Kill a run with SIGKILL mid-way, resume it, and compare with an uninterrupted run:
    accumulation 2, two loader workers, CPU fp32. Checkpoints (every 3) fall inside log
    intervals (every 4), so the resumed run's first logged loss averages steps of both
    processes: the meter's interval is part of the checkpoint."""
    common = dict(train__max_steps=16, checkpoint__every=3, data__num_workers=2, train__log_every=4)
    full = tmp_path / "full"
    kiln("train", *sets(tiny_overrides(full, corpus_dir, **common)))

    killed = tmp_path / "killed"
    proc = start("train", *sets(tiny_overrides(killed, corpus_dir, **common)))
    deadline = time.time() + 120
    while time.time() < deadline:
        steps = list(losses(killed)) if (killed / "metrics.jsonl").exists() else []
        if steps and steps[-1] >= 7:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert steps and steps[-1] < 16, "the run finished before it could be killed"
    kiln("train", *sets(tiny_overrides(killed, corpus_dir, **common)))

    assert losses(killed) == losses(full)
    assert list(losses(full)) == [4, 8, 12, 16]
    assert _scalars(killed, "loss") == _scalars(full, "loss")
    # The final checkpoints are the same in every entry but the wall clock: weights, optimizer,
    # the meter, the data position and every RNG (Python's, NumPy's and torch's), so a resumed
    # run goes on exactly as the straight one would.
    final = "checkpoints/step-00000016"
    (weights_a, state_a), (weights_b, state_b) = checkpoint(full / final), checkpoint(killed / final)
    assert_equal(weights_a, weights_b, "weights")
    state_a["config"]["run"].pop("dir"), state_b["config"]["run"].pop("dir")
    assert_equal(state_a, state_b, "state")
    assert {"python", "numpy", "torch"} <= set(state_a["rng"])


@pytest.mark.slow
def test_two_runs_of_one_seed_write_the_same_checkpoints(tmp_path, corpus_dir):
    """Separate processes, so Python's and NumPy's generators start from the seed, not from
    whatever a process inherited: every entry of the checkpoints is equal but the wall clock."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        kiln("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=4, eval__sample_tokens=0)))
    (weights_a, state_a), (weights_b, state_b) = (checkpoint(r / "checkpoints" / "step-00000004") for r in runs)
    assert_equal(weights_a, weights_b, "weights")
    state_a["config"]["run"].pop("dir"), state_b["config"]["run"].pop("dir")
    assert_equal(state_a, state_b, "state")


def _scalars(run_dir, tag):
    """(step, value) of a TensorBoard scalar, as TensorBoard's own reader gives them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_train_generate_eval(tmp_path, corpus_dir):
    run = tmp_path / "run"
    proc = in_process("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=40, eval__every=20)))
    assert "parameters" in proc.stdout and "sample" in proc.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evals] == [20, 40]
    assert all(m["val_bpb"] > 0 for m in evals)
    train_loss = [m["loss"] for m in metrics if "loss" in m]
    assert train_loss[-1] < train_loss[0]
    assert len(json.loads((run / "data.json").read_text())["corpus_fingerprint"]) == 64
    for name in ("config.toml", "env.json", "model.json", "tokenizer.json", "samples.txt"):
        assert (run / name).exists(), name

    # The other commands on the run directory, by kiln's main() in this process.
    out = in_process("generate", run, "--prompt", "def ", "--max-new-tokens", "20", "--seed", "3").stdout
    assert out.startswith("def ") and len(out) > 5
    again = in_process("generate", run, "--prompt", "def ", "--max-new-tokens", "20", "--seed", "3").stdout
    assert out == again

    ev = json.loads(in_process("eval", run).stdout)
    assert ev["step"] == 40 and ev["val_loss"] == pytest.approx(evals[-1]["val_loss"], rel=0.2)
    other = json.loads(in_process("eval", run, "--data", corpus_dir / "a*.txt").stdout)
    assert other["val_loss"] > 0

    bad = in_process("generate", tmp_path / "nothing", check=False)
    assert bad.returncode == 2 and "nothing" in bad.stderr


def test_tensorboard_events_readable(tmp_path, corpus_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=6)))
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_bpb", "memory/rss_gib"} <= tags
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 7))
    # The process's resident memory: a plausible size for a Python process running torch.
    assert all(0.05 < e.value < 64 for e in acc.Scalars("memory/rss_gib"))


def test_prepare_twice_tokenizes_nothing(tmp_path, corpus_dir):
    args = ["prepare", "--set", f"data.source={corpus_dir}", "--set", "data.vocab_size=300"]
    first = in_process(*args).stdout
    second = in_process(*args).stdout
    assert "kiln: tokenized" in first
    assert "already prepared" in second


def test_resume_never_refuses_existing_checkpoints(tmp_path, corpus_dir):
    run = tmp_path / "run"
    in_process("train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=2)))
    proc = in_process(
        "train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=4)), "--resume", "never", check=False
    )
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    changed = in_process(
        "train", *sets(tiny_overrides(run, corpus_dir, train__max_steps=4, model__d_model=96)), check=False
    )
    assert changed.returncode == 2 and "does not fit this model" in changed.stderr
