"""The study directory: Optuna's journal storage, the setup it was started with, and the file
locks that let several sweep processes share it.

```
STUDY/
  sweep.json       the setup (space, objective, sampler, pruner, seed, base config), checked on every rerun
  study.journal    Optuna's JournalStorage (a file backend; an flock serialises appends)
  trials/0003/     one kiln run directory per trial
  .locks/          journal.lock (appending to the journal), claim.lock (asking for trials),
                   trial-0003.lock (held while trial 3 runs)
```

Locks are ``flock``s: the kernel releases them when their holder dies, so a killed sweep never
leaves a lock behind that others must wait out. A running trial's lock is also held by its
training process (it inherits it), so a trial whose sweep died but whose process still runs is
not taken over until that process has stopped.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any

from kiln.config import ConfigError
from kiln.io import write_atomic
from kiln.sweep.space import Param

STUDY_NAME = "kiln-sweep"
JOURNAL = "study.journal"
SETUP = "sweep.json"
TRIALS = "trials"
LOCKS = ".locks"
# States of trials that are done: each counts towards --trials.
FINISHED = ("COMPLETE", "PRUNED", "FAIL")
# The median pruner compares a trial with the completed ones once this many have completed
# (Optuna's own default), and once the trial is past this share of its steps: a trial's early
# evaluations say little of where it ends (a higher learning rate often starts behind and
# finishes ahead), and a median of one or two trials is noise.
PRUNE_AFTER_TRIALS = 5
PRUNE_WARMUP_SHARE = 1 / 3
TRIAL_CONFIG = "trial.toml"


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            ["kiln sweep needs the optuna package, which is not installed: pip install 'kiln[sweep]'"]
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints its own lines
    return optuna


class FileLock:
    """An exclusive ``flock`` on ``path``; also the lock object of Optuna's JournalFileBackend
    (``acquire``/``release``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, blocking: bool = True) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        # Closing, not LOCK_UN: a child that inherited the descriptor keeps the lock until it exits.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def fileno(self) -> int:
        assert self._fd is not None, "the lock is not held"
        return self._fd

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def trial_dir(study_dir: Path, number: int) -> Path:
    return study_dir / TRIALS / f"{number:04d}"


def live_trial(optuna, study_dir: Path, study, number: int):
    """Trial ``number`` of the study, to report to and ask the pruner: Optuna's public way from
    a trial's number to a live ``Trial`` is its storage's lookup of the trial's id."""
    storage = _storage(optuna, study_dir)
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(STUDY_NAME), number)
    return optuna.trial.Trial(study, trial_id)


def trial_lock(study_dir: Path, number: int) -> FileLock:
    return FileLock(study_dir / LOCKS / f"trial-{number:04d}.lock")


def claim_lock(study_dir: Path) -> FileLock:
    """Held while a sweep process counts trials and asks for one, so that several processes
    neither overshoot --trials nor take over the same trial."""
    return FileLock(study_dir / LOCKS / "claim.lock")


def open_study(study_dir: Path, setup: dict[str, Any], sampler, pruner):
    """The study of ``study_dir``, created on first use. A study started with another setup is
    refused: its trials would not be comparable."""
    optuna = import_optuna()
    with claim_lock(study_dir):
        _check_setup(study_dir, setup)
        return optuna.create_study(
            storage=_storage(optuna, study_dir),
            study_name=STUDY_NAME,
            direction=setup["direction"],
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )


def load_study(study_dir: Path, pruner):
    """The study of ``study_dir``, which exists, with ``pruner`` (in a trial's process)."""
    optuna = import_optuna()
    return optuna.load_study(study_name=STUDY_NAME, storage=_storage(optuna, study_dir), pruner=pruner)


def read_setup(study_dir: Path) -> dict[str, Any]:
    return json.loads((study_dir / SETUP).read_text())


def make_sampler(optuna, params: list[Param], grid: bool, seed: int):
    """TPE (the sweep reseeds it for each trial), or a grid of the parameters' values."""
    if not grid:
        return optuna.samplers.TPESampler(seed=seed)
    sampler = optuna.samplers.GridSampler({p.key: p.grid() for p in params}, seed=seed)
    # Once its grid is done, GridSampler ends Study.optimize with Study.stop, which fails outside
    # optimize; the sweep counts its trials itself.
    sampler.after_trial = lambda *args: None
    return sampler


def make_pruner(
    optuna,
    kind: str,
    eval_every: int,
    max_steps: int | str,
    *,
    after: int = PRUNE_AFTER_TRIALS,
    warmup: float = PRUNE_WARMUP_SHARE,
):
    """The pruner of the study's setup. Steps are training steps: a trial reports at each
    evaluation, from the first (``eval_every``) to its last (``max_steps``, or "auto" where the
    sweep process does not know them yet: only a trial's own process prunes). The median
    pruner prunes a trial only once ``after`` trials have completed and the trial is past the
    ``warmup`` share of its steps, and only where its best value so far is worse than the median
    of the completed trials' at the same step: never a trial ahead of the best completed one."""
    if kind == "median":
        steps = math.ceil(warmup * max_steps) if isinstance(max_steps, int) else 0
        return optuna.pruners.MedianPruner(n_startup_trials=after, n_warmup_steps=steps)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=eval_every or 1, max_resource=max_steps)
    return optuna.pruners.NopPruner()


def _storage(optuna, study_dir: Path):
    lock = FileLock(study_dir / LOCKS / "journal.lock")
    return optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study_dir / JOURNAL), lock_obj=lock)
    )


def _check_setup(study_dir: Path, setup: dict[str, Any]) -> None:
    path = study_dir / SETUP
    if not path.is_file():
        write_atomic(path, json.dumps(setup, indent=2) + "\n")
        return
    before, now = _flat(json.loads(path.read_text())), _flat(json.loads(json.dumps(setup)))
    changed = [
        f"{key} (was {before.get(key)!r}, now {now.get(key)!r})"
        for key in sorted({*before, *now})
        if before.get(key) != now.get(key)
    ]
    if changed:
        raise ConfigError(
            [
                f"{path}: this study was started with another {'; '.join(changed)}; rerun it as it was "
                "started, or use another --study-dir"
            ]
        )


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
