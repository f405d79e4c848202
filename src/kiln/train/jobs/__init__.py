"""Jobs: the kinds of run kiln knows (``base.Job``), and ``job_for``, the one function every
command gets its job from.

``lm``: a language model trained on text; ``finetune``: a Hugging Face model trained on records
(supervised, or on preference pairs or with rewards when ``train.objective`` says so:
``PreferenceJob``, ``GRPOJob``);
``module``: your own ``nn.Module`` through ``kiln.Trainer``. A config's ``run.job`` says which
(``auto`` is resolved here, once, and recorded in the run's config.toml).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kiln.config import Config, ConfigError, validate
from kiln.device import resolve_device, resolve_precision
from kiln.train.jobs.base import EvalContext, Job, LoadedRun
from kiln.train.jobs.finetune import FineTuneJob, uses_records
from kiln.train.jobs.grpo import GRPOJob
from kiln.train.jobs.lm import LMJob
from kiln.train.jobs.module import ModuleJob
from kiln.train.jobs.preference import PreferenceJob

JOBS: dict[str, type[Job]] = {"lm": LMJob, "finetune": FineTuneJob}

__all__ = [
    "EvalContext",
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


def resolve_config(cfg: Config, job: Literal["lm", "finetune", "module"] | None = None) -> Config:
    """``cfg``, validated, with what its "auto" values mean here made concrete: the job kind
    (``run.job``, or ``job`` if given), whether it compiles (``train.compile``) and the precision on
    the device of ``run.device``. This is the one place a run's config changes; from here on it is
    only read."""
    validate(cfg)  # a Config built in Python has not been through load_config
    kind = job or cfg.run.job
    if kind == "auto":
        kind = "finetune" if uses_records(cfg) else "lm"
    train = cfg.train
    if train.compile == "auto":
        train = train.compile_resolved(kind, cfg.parallel.pp)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, job=kind), train=train)
    if cfg.train.precision != "auto":  # resolved already (a run's saved config): its device may be elsewhere
        return cfg
    return resolve_precision(cfg, resolve_device(cfg.run.device))


def job_for(cfg: Config) -> Job:
    """The job ``cfg`` describes, its config resolved (``resolve_config``). Nothing is prepared yet."""
    cfg = resolve_config(cfg)
    if cfg.run.job not in JOBS:
        raise ConfigError(
            [
                f"run.job: {cfg.run.job} runs are made in Python (kiln.Trainer with your own model), which a kiln "
                f"command cannot rebuild; choose one of {', '.join(JOBS)} or auto"
            ]
        )
    if cfg.train.objective != "sft":
        if cfg.run.job != "finetune":
            raise ConfigError(
                [
                    f"train.objective: {cfg.train.objective} trains on records ({{prompt, chosen, rejected}} pairs, "
                    "or grpo's {prompt, ...}, in .jsonl, .csv or .parquet) with a model that has its own tokenizer "
                    f"(model.source = hf:PATH); this config makes a {cfg.run.job} run"
                ]
            )
        return GRPOJob(cfg) if cfg.train.objective == "grpo" else PreferenceJob(cfg)
    return JOBS[cfg.run.job](cfg)
