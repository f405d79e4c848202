"""Which built-in job ``kiln train`` runs: fine-tuning on records, or language modelling on a corpus."""

from __future__ import annotations

import importlib
import os

from kiln.config import Config, ConfigError
from kiln.io import directory_problem
from kiln.train import finetune, lm
from kiln.train.trainer import FitResult, Trainer

# ``package.module:function``, called with the Trainer, returning its ``on_evaluate``: how ``kiln
# sweep`` (a layer above) reports a trial's evaluations and prunes it from inside ``kiln train``.
EVALUATION_HOOK = "KILN_EVALUATION_HOOK"


def build_trainer(cfg: Config, *, console: bool = True) -> Trainer:
    # Before the data is prepared, which can take minutes.
    if problem := directory_problem(cfg.run.dir):
        raise ConfigError([f"run.dir: {problem}"])
    job = finetune if finetune.uses_records(cfg) else lm
    trainer = job.build_trainer(cfg, console=console)
    if hook := os.environ.get(EVALUATION_HOOK):
        module, _, name = hook.partition(":")
        try:
            trainer.on_evaluate = getattr(importlib.import_module(module), name)(trainer)
        except (ImportError, AttributeError) as e:
            raise ConfigError([f"{EVALUATION_HOOK}: cannot load {hook!r}: {e}"]) from None
    return trainer


def train(cfg: Config, *, console: bool = True) -> FitResult:
    return build_trainer(cfg, console=console).fit()
