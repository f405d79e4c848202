"""kiln sweep as a user runs it: real Optuna, trials as real ``kiln train`` / ``kiln launch``
subprocesses on the tiny model, SIGKILL, two sweep processes on one study."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kiln.config import tomllib
from kiln.sweep.study import trial_lock

from conftest import tiny_overrides
from kilnrun import command, in_process, kiln

pytest.importorskip("optuna")  # kiln[sweep]
pytestmark = pytest.mark.e2e


RANK_PROBE = Path(__file__).with_name("rank_probe")
# A pruner that judges from the second completed trial and the first evaluation on, so that a
# study of a few short trials prunes (the default waits for 5 and a third of each trial's steps:
# test_sweep_study.py checks that rule).
EAGER = ("--prune-after", "2", "--prune-warmup", "0")
LR_SPACE = '[train.lr]\ntype = "float"\nlow = 1e-5\nhigh = 3e-2\nlog = true\n'


def _sets(corpus: Path, **extra) -> list[str]:
    items = tiny_overrides(Path("unused"), corpus, eval__sample_tokens=0, **extra)
    return [a for item in items for a in ("--set", item)]


def _args(study: Path, space: Path, sets: list[str], *args: str) -> list[str]:
    return ["sweep", *sets, "--space", str(space), "--study-dir", str(study), *args]


def _command(study: Path, space: Path, sets: list[str], *args: str) -> list[str]:
    return command(*_args(study, space, sets, *args))


def _sweep(study, space, sets, *args, env=None, check=True) -> subprocess.CompletedProcess:
    """``kiln sweep`` run in this process (its trials are processes all the same), or as a process
    of its own where its trials need ``env``."""
    if env is None:
        return in_process(*_args(study, space, sets, *args), check=check)
    return kiln(*_args(study, space, sets, *args), env=env, check=check, timeout=400)


def _space(path: Path, text: str = LR_SPACE) -> Path:
    path.write_text(text)
    return path


def _rows(study: Path) -> list[dict[str, str]]:
    with open(study / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _records(run_dir) if "loss" in r]


def _val_losses(run_dir: Path) -> list[float]:
    return [r["val_loss"] for r in _records(run_dir) if "val_loss" in r]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


@pytest.fixture(scope="module")
def lr_study(tmp_path_factory, corpus_dir):
    """A log-scale learning-rate sweep on the default seed (the config's train.seed): three TPE
    trials, then the same command continued to four with a terrible rate queued first."""
    root = tmp_path_factory.mktemp("lr")
    space, study = _space(root / "space.toml"), root / "study"
    sets = _sets(corpus_dir, train__max_steps=16, eval__every=4, checkpoint__every=8)
    first = _sweep(study, space, sets, "--trials", "3", *EAGER)
    second = _sweep(study, space, sets, "--trials", "4", "--enqueue", "train.lr=1e-5", *EAGER)
    return study, space, sets, first, second


@pytest.mark.slow
def test_a_learning_rate_sweep_finds_a_good_rate_and_prunes_a_bad_one(lr_study):
    study, _, _, first, second = lr_study
    rows = _rows(study)
    assert [r["number"] for r in rows] == ["0", "1", "2", "3"]
    assert list(rows[0]) == ["number", "state", "value", "train.lr", "run_dir", "intermediate"]
    bad = rows[3]
    assert float(bad["train.lr"]) == 1e-5 and bad["state"] == "PRUNED"
    # Pruned at its first evaluation: it stopped there, on a checkpoint, and reported nothing later.
    assert json.loads(bad["intermediate"]).keys() == {"4"}
    run = Path(bad["run_dir"])
    assert _checkpoints(run) == [4] and max(s for s, _ in _losses(run)) == 4
    assert "trial 3 pruned at step 4" in second.stdout
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    assert len(complete) >= 2
    best, worst = min(float(r["value"]) for r in complete), max(float(r["value"]) for r in rows)
    assert best < worst - 0.3, rows
    # The first command ran three trials; the second ran only the one it added.
    assert first.stdout.count("started") == 3 and second.stdout.count("started") == 1
    for r in complete:  # each trial is an ordinary kiln run, evaluated at the end
        run = Path(r["run_dir"])
        assert (run / "config.toml").is_file() and (run / "tensorboard").is_dir() and 16 in _checkpoints(run)
        assert _val_losses(run)[-1] == float(r["value"])
        evaluations = dict(zip(("4", "8", "12", "16"), _val_losses(run), strict=True))
        assert json.loads(r["intermediate"]) == evaluations
    assert (study / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "trial" in second.stdout and "PRUNED" in second.stdout  # the table


@pytest.mark.slow
def test_best_toml_trains_again_to_the_same_val_loss(lr_study, tmp_path):
    study = lr_study[0]
    best = min((r for r in _rows(study) if r["state"] == "COMPLETE"), key=lambda r: float(r["value"]))
    config = tomllib.loads((study / "best.toml").read_text())
    assert config["train"]["lr"] == float(best["train.lr"])
    again = tmp_path / "again"
    in_process("train", study / "best.toml", "--set", f"run.dir={again}")
    assert _val_losses(again)[-1] == float(best["value"])  # to the last bit
    assert _val_losses(again) == _val_losses(Path(best["run_dir"]))


@pytest.mark.slow
def test_continuing_with_another_setup_is_refused(lr_study):
    study, space, sets, _, _ = lr_study
    other = _space(space.with_name("other.toml"), LR_SPACE.replace("3e-2", "1e-1"))
    proc = _sweep(study, other, sets, "--trials", "5", *EAGER, check=False)
    assert proc.returncode == 2
    assert f"{study / 'sweep.json'}: this study was started with another space.train.lr.high" in proc.stderr
    assert len(_rows(study)) == 4


@pytest.mark.slow
def test_a_killed_sweep_continues_its_trial_from_its_checkpoint(tmp_path, corpus_dir):
    """SIGKILL to the sweep's process group mid-trial: the trial's process checkpoints and exits
    (it is not left running), and the same command finishes the study: the finished trial is
    kept, the interrupted one resumes and trains as if never stopped, nothing runs twice."""
    space, study = _space(tmp_path / "space.toml"), tmp_path / "study"
    sets = _sets(corpus_dir, train__max_steps=20, eval__every=10, checkpoint__every=5)
    args = ("--trials", "2", "--pruner", "none")
    sweep = subprocess.Popen(
        _command(study, space, sets, *args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    second = study / "trials" / "0001"
    deadline = time.time() + 240
    steps = []
    while time.time() < deadline and sweep.poll() is None:
        steps = [s for s, _ in _losses(second)] if (second / "metrics.jsonl").exists() else []
        if steps and steps[-1] >= 7:
            break
        time.sleep(0.05)
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    assert steps and steps[-1] < 20, "trial 1 finished before the sweep could be killed"
    lock = trial_lock(study, 1)
    deadline = time.time() + 60
    while not lock.acquire(blocking=False):  # held by the trial's process while it runs
        assert time.time() < deadline, "the trial's process still runs after its sweep was killed"
        time.sleep(0.1)
    lock.release()
    stopped_at = _checkpoints(second)[-1]
    assert steps[-1] <= stopped_at < 20  # it saved where it stopped, not only at its last 5-step checkpoint

    proc = _sweep(study, space, sets, *args)
    assert "trial 1 was left running by a sweep that stopped; continuing it" in proc.stdout
    assert "trial 0 started" not in proc.stdout and "trial 0 was left" not in proc.stdout  # finished, kept
    rows = _rows(study)
    assert [(r["number"], r["state"]) for r in rows] == [("0", "COMPLETE"), ("1", "COMPLETE")]
    log = (second / "train.log").read_text()
    assert log.count("kiln: model") == 2 and f"resumed from {second}/checkpoints/step-{stopped_at:08d}" in log
    assert (study / "trials" / "0000" / "train.log").read_text().count("kiln: model") == 1

    reference = tmp_path / "reference"
    in_process("train", str(second / "trial.toml"), "--set", f"run.dir={reference}")
    assert _losses(second) == _losses(reference)
    assert _val_losses(second) == _val_losses(reference) and _val_losses(second)[-1] == float(rows[1]["value"])


def test_an_objective_the_trials_do_not_log_stops_the_sweep(tmp_path, corpus_dir):
    space, study = _space(tmp_path / "space.toml"), tmp_path / "study"
    sets = _sets(corpus_dir, train__max_steps=4, eval__every=2)
    proc = _sweep(study, space, sets, "--trials", "3", "--objective", "val_accuracy", check=False)
    assert proc.returncode == 2
    assert (
        proc.stderr.splitlines()[-1]
        == "kiln: config error: --objective val_accuracy: evaluations log val_loss, val_ppl, val_bpb"
    )
    assert [(r["number"], r["state"]) for r in _rows(study)] == [("0", "FAIL")]
    assert _checkpoints(study / "trials" / "0000") == [2]  # stopped at its first evaluation


@pytest.mark.slow
def test_two_sweep_processes_share_one_grid(tmp_path, corpus_dir):
    """6 grid points, two sweep processes on one study directory (one running two trials at a
    time): each point runs exactly once, by one of them, and both finish with the whole study."""
    space = _space(
        tmp_path / "space.toml",
        "[train.lr]\ntype = 'float'\nchoices = [1e-3, 1e-2, 3e-2]\n"
        "[train.warmup_steps]\ntype = 'int'\nlow = 0\nhigh = 1\n",
    )
    study = tmp_path / "study"
    sets = _sets(corpus_dir, train__max_steps=2, checkpoint__every=0)
    commands = [_command(study, space, sets, "--sampler", "grid", *extra) for extra in (["--parallel", "2"], [])]
    sweeps = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    outs = [s.communicate(timeout=600) for s in sweeps]
    for s, (out, err) in zip(sweeps, outs, strict=True):
        assert s.returncode == 0 and "Traceback" not in err and "rror" not in err, out[-2000:] + err[-2000:]
    rows = _rows(study)
    assert [int(r["number"]) for r in rows] == list(range(6))
    assert {r["state"] for r in rows} <= {"COMPLETE", "PRUNED"}
    points = sorted((float(r["train.lr"]), int(r["train.warmup_steps"])) for r in rows)
    assert points == sorted((lr, w) for lr in (1e-3, 1e-2, 3e-2) for w in range(2))
    started = [[int(line.split()[2]) for line in out.splitlines() if " started: " in line] for out, _ in outs]
    assert sorted(started[0] + started[1]) == list(range(6))  # each trial started once, by one process
    assert started[0] and started[1]  # both took part
    for r in rows:
        run = Path(r["run_dir"])
        assert (run / "train.log").read_text().count("kiln: model") == 1
        # The process running two trials at a time gives each half of the CPU's threads.
        threads = tomllib.loads((run / "config.toml").read_text())["run"]["threads"]
        assert threads == (max(1, _cores() // 2) if int(r["number"]) in started[0] else 0)


@pytest.mark.slow
@pytest.mark.dist
def test_trials_on_two_ranks_share_their_values_and_stop_together_when_pruned(tmp_path, corpus_dir):
    space, study = _space(tmp_path / "space.toml"), tmp_path / "study"
    sets = _sets(corpus_dir, train__max_steps=12, train__micro_batch_size=2, eval__every=3, checkpoint__every=6)
    rates = ("1e-2", "1e-5")
    enqueue = [a for lr in rates for a in ("--enqueue", f"train.lr={lr}")]
    # Pruning from the first completed trial on: the second is judged against the first.
    proc = _sweep(
        study,
        space,
        sets,
        "--trials",
        "2",
        "--nproc-per-node",
        "2",
        *enqueue,
        "--prune-after",
        "1",
        "--prune-warmup",
        "0",
        env={"PYTHONPATH": str(RANK_PROBE)},
    )
    rows = _rows(study)
    assert [(float(r["train.lr"]), r["state"]) for r in rows] == [(1e-2, "COMPLETE"), (1e-5, "PRUNED")]
    for r in rows:
        run = Path(r["run_dir"])
        ranks = [tomllib.loads((run / f"rank-{rank}.toml").read_text()) for rank in (0, 1)]
        assert ranks[0] == ranks[1] and ranks[0]["train"]["lr"] == float(r["train.lr"])
        assert json.loads((run / "env.json").read_text())["world_size"] == 2
    pruned = Path(rows[1]["run_dir"])
    # Both ranks stopped at the evaluation that pruned the trial, and saved it (a sharded-or-not
    # checkpoint needs every rank), then the sweep went on: nobody hung.
    assert _checkpoints(pruned) == [3] and max(s for s, _ in _losses(pruned)) == 3
    assert "trial 1 pruned at step 3" in proc.stdout
