"""The study directory without training: seeded draws, and the locks that make it safe to share."""

import subprocess
import sys

import pytest

from kiln.sweep.driver import Driver, Options
from kiln.sweep.space import Param
from kiln.sweep.study import FileLock, import_optuna, make_sampler, open_study

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
