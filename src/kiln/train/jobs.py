"""Which built-in job ``kiln train`` runs: fine-tuning on records, or language modelling on a corpus."""

from __future__ import annotations

from kiln.config import Config, ConfigError
from kiln.io import directory_problem
from kiln.train import finetune, lm
from kiln.train.trainer import FitResult, Trainer


def build_trainer(cfg: Config, *, console: bool = True) -> Trainer:
    # Before the data is prepared, which can take minutes.
    if problem := directory_problem(cfg.run.dir):
        raise ConfigError([f"run.dir: {problem}"])
    job = finetune if finetune.uses_records(cfg) else lm
    return job.build_trainer(cfg, console=console)


def train(cfg: Config, *, console: bool = True) -> FitResult:
    return build_trainer(cfg, console=console).fit()
