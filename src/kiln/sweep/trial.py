"""One trial of a sweep, in its own training process: ``kiln sweep-trial STUDY_DIR NUMBER``
(under ``kiln launch`` for several ranks), which the sweep starts for each trial.

It trains the trial's config (``STUDY_DIR/trials/NNNN/trial.toml``, written by the sweep) with a
``PruningHook`` as the Trainer's ``on_evaluate``: on rank 0, after each evaluation, the hook
reports the objective to the trial in the study's storage and asks the pruner; a pruned trial
is recorded as PRUNED, and the Trainer stops it at that step on every rank (they agree on rank
0's answer) with a checkpoint. Other ranks never touch Optuna.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.config import Config, ConfigError, load_config
from kiln.sweep.study import TRIAL_CONFIG, import_optuna, live_trial, load_study, make_pruner, read_setup, trial_dir

if TYPE_CHECKING:
    import optuna


def trial_config(study_dir: Path, number: int) -> Config:
    """The config the sweep wrote for trial ``number`` of the study in ``study_dir``."""
    path = trial_dir(study_dir, number) / TRIAL_CONFIG
    if not path.is_file():
        raise ConfigError([f"{path}: no such trial config; kiln sweep writes it when it starts trial {number}"])
    return load_config(path)


class PruningHook:
    """The Trainer's ``on_evaluate`` in trial ``number`` of the study in ``study_dir`` (called on
    rank 0): True stops the trial there. ``eval_every``: the trial's evaluation interval."""

    def __init__(self, study_dir: Path, number: int, eval_every: int):
        self.study_dir, self.number, self.eval_every = study_dir, number, eval_every
        self.setup = read_setup(study_dir)
        self.objective = self.setup["objective"]
        # Opened at the first evaluation, by rank 0 only.
        self.optuna: ModuleType | None = None
        self.trial: optuna.trial.Trial | None = None
        self.reported: set[int] = set()

    def __call__(self, step: int, metrics: dict[str, Any], max_steps: int) -> bool:
        if self.trial is None:
            self._open(max_steps)
        assert self.optuna is not None and self.trial is not None  # opened just now or before
        states = self.optuna.trial.TrialState
        value = metrics.get(self.objective)
        if not isinstance(value, (int, float)):
            logged = ", ".join(k for k, v in metrics.items() if isinstance(v, (int, float)))
            self.trial.set_user_attr("error", f"--objective {self.objective}: evaluations log {logged}")
            self.trial.study.tell(self.trial, state=states.FAIL)
            return True
        if step not in self.reported:  # steps redone after a resume were reported before
            self.trial.report(value, step)
            self.reported.add(step)
        if step >= max_steps or not self.trial.should_prune():
            return False  # the last evaluation is the trial's result
        self.trial.study.tell(self.trial, state=states.PRUNED)
        print(
            f"kiln: trial {self.number} pruned at step {step} ({self.objective} {value:.5g}, "
            f"{self.setup['pruner']} pruner); stopping it",
            flush=True,
        )
        return True

    def _open(self, max_steps: int) -> None:
        self.optuna = import_optuna()
        setup = self.setup
        pruner = make_pruner(
            self.optuna,
            setup["pruner"],
            self.eval_every,
            max_steps,
            after=setup["prune_after"],
            warmup=setup["prune_warmup"],
        )
        study = load_study(self.study_dir, pruner)
        self.trial = live_trial(self.optuna, self.study_dir, study, self.number)
        self.reported = set(study.get_trials(deepcopy=False)[self.number].intermediate_values)
