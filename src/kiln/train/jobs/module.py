"""Your own ``nn.Module`` as a job: the model, the data and the loss are given (``kiln.Trainer``),
not built from the config, so only Python can make this job again (``run.job = "module"``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from kiln.config import Config
from kiln.distributed.world import World
from kiln.models.family import ParallelPlan
from kiln.train.jobs.base import EvalContext, Job


class ModuleJob(Job):
    """``eval_fn(model)`` returns a dict of validation metrics; ``sample_fn(model, step)`` text
    to show (e.g. a generated sample, skipped where the model is split over tensor- or
    pipeline-parallel ranks); both run in eval mode, without gradients, under the run's
    precision. ``plan``: how parallelism and activation checkpointing apply (by default the
    model's ``blocks``, no tensor parallelism)."""

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        train_data: Dataset,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        eval_fn: Callable[[nn.Module], dict[str, Any]] | None = None,
        sample_fn: Callable[[nn.Module, int], str] | None = None,
        tokens_per_sample: int = 1,
        flops_per_token: float | None = None,
        plan: ParallelPlan | None = None,
        collate_fn: Callable[[list], Any] = default_collate,
    ):
        super().__init__(cfg)
        self._model, self.train_data, self.loss_fn, self.collate_fn = model, train_data, loss_fn, collate_fn
        self.eval_fn, self.sample_fn = eval_fn, sample_fn
        self.tokens_per_sample, self.flops_per_token = tokens_per_sample, flops_per_token
        self.plan = plan or ParallelPlan.infer(model)

    def prepare(self, world: World, console: bool) -> None:
        """Everything is given."""

    def model(self) -> nn.Module:
        return self._model

    def evaluate(self, model: nn.Module, ctx: EvalContext) -> dict[str, Any] | None:
        return None if self.eval_fn is None else self.eval_fn(model)

    def sample(self, model: nn.Module, ctx: EvalContext) -> str | None:
        if self.sample_fn is None:
            return None
        return self.sample_fn(model, ctx.step)
