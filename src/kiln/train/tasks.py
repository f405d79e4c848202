"""Benchmark tasks scored during training (eval.tasks): lm-evaluation-harness runs on the model
being trained every eval.tasks_every steps and at the end, its scores logged as
``tasks/<task>/<metric>``.

Every rank scores the same documents with its own model: a whole replica (one process, DDP), an
FSDP shard, whose forward passes gather the parameters together, so all ranks run the same
collectives, or the layout's forward of whole rows (tensor-parallel ranks, pipeline stages:
``ParallelModel.eval_forward``, whose decode steps run a pipeline's stages in turn too); rank
0's logger writes the scores.
The run is not changed by it: the model is in eval mode without gradients while it is scored,
and every random generator lm-eval seeds (Python's, NumPy's, PyTorch's) is put back as it was,
so the per-step losses are bitwise those of the same run without task scores.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from kiln.config import Config
from kiln.distributed.parallel import ParallelModel
from kiln.train.precision import Precision

if TYPE_CHECKING:
    from kiln.train.run import Progress


class TaskScores:
    """The loop's component (after each step, ``kiln.train.after_step``) that scores ``model``, a
    ``ParallelModel``, when ``eval.tasks`` are due."""

    phase = "tasks"

    def __init__(self, cfg: Config, job: Any, model: ParallelModel, precision: Precision):
        e = cfg.eval
        self.names, self.every, self.limit = list(e.tasks), e.tasks_every, e.tasks_limit
        self.job, self.model, self.precision = job, model, precision
        self.manager: Any = None
        if self.names:  # checked before training starts: a bad task name is an error at once
            from kiln.harness import check_tasks, task_manager

            self.manager = task_manager(e.tasks_include or None, self.names)
            check_tasks(self.names, self.manager)

    def due(self, step: int, final: bool) -> bool:
        return bool(self.names) and (final or (self.every > 0 and step % self.every == 0))

    def after_step(self, run: Progress) -> None:
        if self.due(run.step, run.final):
            self.score(self.model.eval_forward, run.step, run.micro_batch_size, run.logger, self.precision)

    def score(
        self, model: nn.Module, step: int, micro_batch_size: int, logger: Any, precision: Precision
    ) -> dict[str, float]:
        """Score the tasks with ``model`` (on every rank); rank 0's logger writes the scores."""
        from kiln.harness import run_tasks, scores
        from kiln.harness.model import KilnLM

        job = self.job
        context = job.family.context_length(job.args) or job.cfg.data.seq_len
        lm = KilnLM(model, job.family, job.tokenizer, context, batch_size=micro_batch_size)
        was_training = model.training
        states = random.getstate(), np.random.get_state()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), precision.autocast():
                model.eval()
                results = run_tasks(lm, self.names, self.manager, limit=self.limit or None, bootstrap_iters=0)
        finally:
            model.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
        if results is None:  # another rank's scores: rank 0 logs them
            return {}
        metrics = scores(results)
        logger.log(step, metrics)
        return metrics
