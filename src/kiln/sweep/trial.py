"""The sweep inside a trial's training process. The sweep starts ``kiln train`` (or ``kiln
launch``) with ``KILN_EVALUATION_HOOK=kiln.sweep.trial:PruningHook``; the Trainer calls the hook
on rank 0 after each evaluation. It reports the objective to the trial in the study's storage and
asks the pruner; a pruned trial is recorded as PRUNED, and the Trainer stops it at that step on
every rank (they agree on rank 0's answer) with a checkpoint. Other ranks never touch Optuna.

A trial's run directory is ``STUDY/trials/NNNN``: that is how the hook finds its study and trial.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.sweep.study import import_optuna, load_study, make_pruner, read_setup

HOOK = "kiln.sweep.trial:PruningHook"


class PruningHook:
    """The Trainer's ``on_evaluate`` in a trial (called on rank 0): True stops the trial there."""

    def __init__(self, trainer):
        self.trainer = trainer
        run_dir = Path(trainer.cfg.run.dir)
        self.study_dir, self.number = run_dir.parent.parent, int(run_dir.name)
        self.setup = read_setup(self.study_dir)
        self.objective = self.setup["objective"]
        self.optuna = self.trial = None  # opened at the first evaluation, by rank 0 only
        self.reported: set[int] = set()

    def __call__(self, step: int, metrics: dict[str, Any]) -> bool:
        if self.trial is None:
            self._open()
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
        if step >= self.trainer.cfg.train.max_steps or not self.trial.should_prune():
            return False  # the last evaluation is the trial's result
        self.trial.study.tell(self.trial, state=states.PRUNED)
        print(
            f"kiln: trial {self.number} pruned at step {step} ({self.objective} {value:.5g}, "
            f"{self.setup['pruner']} pruner); stopping it",
            flush=True,
        )
        return True

    def _open(self) -> None:
        self.optuna = import_optuna()
        cfg = self.trainer.cfg  # max_steps = auto is resolved by now
        pruner = make_pruner(self.optuna, self.setup["pruner"], cfg.eval.every, cfg.train.max_steps)
        study = load_study(self.study_dir, pruner)
        frozen = study.get_trials(deepcopy=False)[self.number]
        self.reported = set(frozen.intermediate_values)
        # Optuna has no public way to go from a FrozenTrial to a live Trial.
        self.trial = self.optuna.trial.Trial(study, frozen._trial_id)
