"""Jobs: the kinds of run kiln knows (``base.Job``), one for each value of ``run.job``, and
``job_for``, the one function every command gets its job from.

``lm``: a language model trained on text (``LMJob``); on records, with a Hugging Face model:
``sft`` and ``classify`` (``FineTuneJob``), the preference objectives ``dpo``, ``ipo``,
``simpo``, ``orpo`` and ``kto`` (``PreferenceJob``) and ``grpo`` (``GRPOJob``); ``module``: your
own ``nn.Module`` through ``kiln.Trainer`` (``ModuleJob``). ``auto`` is resolved here, once,
and recorded in the run's config.toml.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kiln.config import Config, ConfigError, validate
from kiln.device import resolve_device, resolve_precision
from kiln.train.jobs.base import EvalContext, FamilyJob, Job, LoadedRun
from kiln.train.jobs.finetune import FineTuneJob, uses_records
from kiln.train.jobs.grpo import GRPOJob
from kiln.train.jobs.lm import LMJob
from kiln.train.jobs.module import ModuleJob
from kiln.train.jobs.preference import PreferenceJob
from kiln.train.preference import OBJECTIVES

# What each run.job is made by (module: only Python makes it, from your model).
JOBS: dict[str, type[FamilyJob]] = {
    "lm": LMJob,
    "sft": FineTuneJob,
    "classify": FineTuneJob,
    **dict.fromkeys(OBJECTIVES, PreferenceJob),
    "grpo": GRPOJob,
}

__all__ = [
    "EvalContext",
    "FamilyJob",
    "FineTuneJob",
    "GRPOJob",
    "Job",
    "LMJob",
    "LoadedRun",
    "ModuleJob",
    "PreferenceJob",
    "job_for",
    "resolve_config",
]


def resolve_config(cfg: Config, job: Literal["module"] | None = None) -> Config:
    """``cfg``, validated, with what its "auto" values mean here made concrete: the job
    (``run.job``, or ``job`` if given) with the model's task it implies, whether it compiles
    (``train.compile``) and the precision on the device of ``run.device``. This is the one place
    a run's config changes; from here on it is only read."""
    validate(cfg)  # a Config built in Python has not been through load_config
    kind, model = job or cfg.run.job, cfg.model
    if kind == "auto":
        classify = model.task == "sequence_classification"
        kind = "classify" if classify else "sft" if uses_records(cfg) else "lm"
    if kind == "classify":
        model = dataclasses.replace(model, task="sequence_classification")
    elif model.task == "sequence_classification" and kind != "module":
        raise ConfigError([f"model.task: sequence_classification is trained by run.job = classify, not {kind}"])
    train = cfg.train
    if train.compile == "auto":
        train = train.compile_resolved(kind, cfg.parallel.pp)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, job=kind), model=model, train=train)
    if cfg.train.precision != "auto":  # resolved already (a run's saved config): its device may be elsewhere
        return cfg
    return resolve_precision(cfg, resolve_device(cfg.run.device))


def job_for(cfg: Config) -> FamilyJob:
    """The job ``cfg`` describes, its config resolved (``resolve_config``). Nothing is prepared yet."""
    cfg = resolve_config(cfg)
    if cfg.run.job not in JOBS:
        raise ConfigError(
            [
                f"run.job: {cfg.run.job} runs are made in Python (kiln.Trainer with your own model), which a kiln "
                f"command cannot rebuild; choose one of {', '.join(JOBS)} or auto"
            ]
        )
    return JOBS[cfg.run.job](cfg)
