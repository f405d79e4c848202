"""The study directory without training: seeded draws, and the locks that make it safe to share."""

import subprocess
import sys

import pytest

from kiln.sweep.driver import Driver, Options
from kiln.sweep.space import Param
from kiln.sweep.study import (
    PRUNE_AFTER_TRIALS,
    PRUNE_WARMUP_SHARE,
    FileLock,
    import_optuna,
    make_pruner,
    make_sampler,
    open_study,
)

pytest.importorskip("optuna")  # kiln[sweep]

PARAMS = [
    Param("train.lr", "float", low=1e-5, high=3e-2, log=True),
    Param("train.schedule", "categorical", choices=("cosine", "wsd")),
    Param("train.warmup_steps", "int", low=0, high=100, step=10),
]


def _draws(study_dir, seed: int, trials: int, params=PARAMS, grid: bool = False) -> list[dict]:
    """The values of each new trial up to ``trials``, as one sweep process asks for them."""
    optuna = import_optuna()
    study = open_study(study_dir, {"direction": "minimize"}, make_sampler(optuna, params, grid, seed), None)
    driver = Driver(Options(None, [], params, study_dir, trials, "val_loss", grid, seed, 1, 1), study, optuna)
    draws = []
    while (r := driver.claim()) is not None:
        draws.append({p.key: p.suggest(r.trial, grid) for p in params})
        study.tell(r.trial, float(len(draws) % 3))
        r.lock.release()
        driver.running.remove(r)
    return draws


def test_the_same_seed_draws_the_same_values_also_when_continued(tmp_path):
    draws = _draws(tmp_path / "a", seed=7, trials=4)
    assert len(draws) == 4 and len({d["train.lr"] for d in draws}) == 4
    assert _draws(tmp_path / "b", seed=7, trials=4) == draws
    assert _draws(tmp_path / "c", seed=8, trials=4) != draws
    # A study stopped after two trials and continued by another process draws what one that ran through drew.
    assert _draws(tmp_path / "d", seed=7, trials=2) == draws[:2]
    assert _draws(tmp_path / "d", seed=7, trials=4) == draws[2:]


def test_a_grid_hands_out_each_point_once(tmp_path):
    params = [Param("train.lr", "float", choices=(1e-3, 1e-2)), Param("train.warmup_steps", "int", low=0, high=2)]
    draws = _draws(tmp_path, seed=0, trials=6, params=params, grid=True)
    assert sorted((d["train.lr"], d["train.warmup_steps"]) for d in draws) == [
        (lr, w) for lr in (1e-3, 1e-2) for w in range(3)
    ]


def test_a_trial_lock_is_held_by_the_training_process_until_it_dies(tmp_path):
    lock = FileLock(tmp_path / "trial.lock")
    assert lock.acquire()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fileno(),))
    lock.release()  # the sweep process is gone; its trial still runs
    other = FileLock(tmp_path / "trial.lock")
    assert not other.acquire(blocking=False)
    child.kill()
    child.wait()
    assert other.acquire(blocking=False)  # the kernel let go of it with the process
    other.release()


def test_the_median_pruner_waits_and_never_prunes_a_trial_ahead_of_the_best():
    """The rule of --pruner median (60-step trials evaluated every 15 steps): nothing is pruned
    before PRUNE_AFTER_TRIALS trials have completed, nor within the first PRUNE_WARMUP_SHARE of a
    trial's steps; after that, a trial is pruned where its best value so far is worse than the
    completed trials' median at the same step, and a trial ahead of the best completed one never is."""
    optuna = import_optuna()
    study = optuna.create_study(direction="minimize", pruner=make_pruner(optuna, "median", 15, 60))

    def complete(value: float) -> None:
        trial = study.ask()
        for step in (15, 30, 45, 60):
            trial.report(value, step)
        study.tell(trial, value)

    def pruned_at(values: dict[int, float]) -> list[int]:
        trial, out = study.ask(), []
        for step, value in values.items():
            trial.report(value, step)
            if trial.should_prune():
                out.append(step)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # out of the way of the next
        return out

    behind = {15: 9.0, 30: 9.0, 45: 9.0}
    for value in (1.0, 1.1, 1.2, 1.3)[: PRUNE_AFTER_TRIALS - 1]:
        complete(value)
    assert pruned_at(behind) == []  # too few completed trials to judge by
    complete(1.4)
    assert 15 < PRUNE_WARMUP_SHARE * 60 < 30  # the first evaluation is inside the warm-up
    assert pruned_at(behind) == [30, 45]  # past the warm-up, and behind the median (1.2)
    assert pruned_at({15: 1.25, 30: 1.25, 45: 1.25}) == [30, 45]
    assert pruned_at({15: 1.15, 30: 1.15, 45: 1.15}) == []  # better than the median
    assert pruned_at({15: 9.0, 30: 0.9, 45: 0.8}) == []  # ahead of the best completed trial
