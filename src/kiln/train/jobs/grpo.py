"""The GRPO job: a fine-tuning run (a model with its own tokenizer, records) that learns from a
reward function on its own sampled completions of ``{prompt, ...}`` records (``kiln.data.prompts``,
``kiln.train.grpo``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from kiln.checkpoint import Stateful
from kiln.config import ConfigError
from kiln.data.prompts import PromptBatch, PromptData, prepare_prompts
from kiln.distributed.world import World
from kiln.train.grpo import GRPOLoss, Rewards, Rollout
from kiln.train.jobs.base import EvalContext, LoadedRun, ValidationRows
from kiln.train.jobs.finetune import FineTuneJob


class GRPOJob(FineTuneJob):
    prompts: PromptData

    @property
    def manifest(self) -> dict[str, Any]:
        return self.prompts.manifest

    def prepare(self, world: World, console: bool) -> None:
        cfg = self.cfg
        if cfg.data.packing:
            raise ConfigError(["data.packing: grpo samples completions of its prompts; set data.packing=false"])
        room = cfg.data.seq_len - cfg.grpo.max_new_tokens
        if room < 1:
            raise ConfigError(
                [
                    f"grpo.max_new_tokens: {cfg.grpo.max_new_tokens} leaves no room for the prompt in data.seq_len="
                    f"{cfg.data.seq_len}; raise data.seq_len or lower grpo.max_new_tokens"
                ]
            )
        reward = self._reward(world)
        self.resolve_model()
        self.prompts = data = prepare_prompts(cfg.data, self.tokenizer, room)
        self.train_data, self.collate_fn = data.train, data.collate
        self.tokens_per_sample = cfg.grpo.group_size * cfg.data.seq_len
        self.flops_per_token = None  # the sampled lengths vary: no MFU
        self.plan = self.family.parallel_plan(self.args)
        self.objective = GRPOLoss(cfg, self.family, self.tokenizer, reward, world)
        self.loss_fn = self.objective
        self.repeat = cfg.grpo.iterations  # each batch of prompts for a cycle of steps, as its rollout

    def _reward(self, world: World) -> Rewards:
        return Rewards.of(self.cfg.grpo, world.device)

    def rollout(self, model: nn.Module, batch: PromptBatch, micro_batch_size: int, step: int) -> Rollout:
        return self.objective.rollout(model, batch, micro_batch_size, step)

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """The rollout a cycle of grpo.iterations steps trains on, where there are such cycles."""
        return {"grpo_rollout": self.objective.kept} if self.cfg.grpo.iterations > 1 else {}

    def metrics(self, world: World) -> dict[str, float]:
        return self.objective.metrics(world)

    def evaluate(self, model: nn.Module, ctx: EvalContext) -> dict[str, Any]:
        return self.objective.evaluate(model, self.prompts.val.batches(self.prompts.collate, ctx.micro_batch_size))

    def describe(self, model: nn.Module) -> list[str]:
        m, g = self.manifest, self.cfg.grpo
        return [
            f"model {self.family.describe(self.cfg.model, self.args, model)}",
            f"grpo ({g.group_size} completions a prompt, up to {g.max_new_tokens} tokens, "
            f"reward {' + '.join(self.objective.rewards.names)}, loss {g.loss}): "
            f"{m['records']['train']:,} train / {m['records']['val']:,} val prompts ({m['split']})",
        ]

    def validation_rows(self, tokenizer: Any, run_dir: Path, rows: int) -> ValidationRows:
        """Each record's prompt."""
        cfg = self.cfg
        prompts = prepare_prompts(cfg.data, tokenizer, cfg.data.seq_len).val.rows[:rows]
        return ValidationRows(
            [r["prompt_ids"] for r in prompts], None, f"{len(prompts)} validation records of {cfg.data.source}"
        )

    def evaluate_saved(
        self, run: LoadedRun, *, source: str | None, max_batches: int | None, batch_size: int | None
    ) -> dict[str, Any]:
        """The mean reward of greedy completions of the run's validation prompts."""
        cfg = self.cfg
        if source is not None:
            raise ConfigError(["kiln eval --data: a grpo run is scored on its own validation prompts; leave it out"])
        self.tokenizer, self.args = run.tokenizer, run.args
        self.prompts = prepare_prompts(cfg.data, run.tokenizer, cfg.data.seq_len - cfg.grpo.max_new_tokens)
        self.objective = GRPOLoss(cfg, self.family, run.tokenizer, self._reward(World()), World())
        size = batch_size or cfg.train.nominal_micro_batch
        batches = self.prompts.val.batches(self.prompts.collate, size)[:max_batches]
        return {**self.objective.evaluate(run.model, batches), "step": run.step}
