"""GRPO (Shao et al. 2024): reinforcement learning with verifiable rewards. For each prompt of a
micro-batch the model samples a group of completions with kiln's batched decoder, a reward
function scores them, and each completion's advantage is its reward against its group's; the
loss raises the log-probability of the completion's tokens in proportion to it (optionally minus
a KL estimate to the reference model, the model with its LoRA adapters off).

Sampling is the job's rollout, a phase of the loop before each step (``Job.rollout``) that turns
the step's prompts into scored completions (a ``Rollout``), so the loss is an ordinary forward of
whatever layout the model has. Each group of completions is sampled and trained on in one step
(on-policy: the policy ratio of the clipped surrogate is exactly 1, as in TRL with one iteration
per generation, so no clip constant is offered). Every completion weighs the same in the mean, whatever the accumulation
and ranks. Sampling draws its seed from the global torch generator, which checkpoints keep, so a
resumed run samples what the uninterrupted one did. Generation and training time are reported
apart.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import Config, ConfigError
from kiln.data.batch import RowBatch, TokenBatch, pad_id, pad_rows
from kiln.data.prompts import PromptBatch
from kiln.distributed.world import World
from kiln.labels import IGNORE_INDEX
from kiln.models.decode import Decoder, Row, Sampling
from kiln.models.family import ModelFamily
from kiln.models.hf.loading import read_config
from kiln.train.logps import token_logps
from kiln.train.preference import adapters_disabled

# Means over the log interval's completions; and the interval's generation time on this rank.
METRICS = ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "kl")


def load_reward(spec: str) -> Callable[..., list[float | None]]:
    """The function ``package.module:function`` names (ConfigError naming grpo.reward if not)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError([f"grpo.reward: {spec!r} is not package.module:function"])
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError([f"grpo.reward: cannot import {spec}: {e}"]) from None
    if not callable(function):
        raise ConfigError([f"grpo.reward: {spec} is not callable"])
    return function


class RewardModel:
    """A sequence classifier in ``transformers``' format as a reward function (a kiln
    classification run exported with ``kiln export RUN --format hf``, or any such directory): the
    probability it gives ``label`` (its last class if empty) for each prompt + completion, read as
    one text (a chat prompt's messages' contents joined by newlines)."""

    def __init__(self, path: str, label: str, device: torch.device):
        from kiln.compat import quiet_library_imports

        quiet_library_imports()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        directory = Path(path)
        if (directory / "config.toml").is_file() and not (directory / "config.json").is_file():
            raise ConfigError(
                [f"grpo.reward_model: {path} is a kiln run directory; export it first: kiln export {path} --format hf"]
            )
        read_config(directory, "grpo.reward_model")  # not one that needs its own code, a known architecture
        try:
            # As every model kiln loads: no download, no code from the directory, safetensors only.
            model = AutoModelForSequenceClassification.from_pretrained(
                directory, local_files_only=True, trust_remote_code=False, use_safetensors=True
            )
            self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise ConfigError(
                [f"grpo.reward_model: {path}: not a sequence classifier in transformers' format ({e})"]
            ) from None
        labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
        if label and label not in labels:
            raise ConfigError([f"grpo.reward_label: {label!r} is not one of {path}'s classes ({', '.join(labels)})"])
        self.model, self.device = model.to(device).eval(), device
        self.index = labels.index(label) if label else len(labels) - 1

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
        def text(prompt: Any) -> str:
            return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)

        encoded = self.tokenizer(
            [text(p) + c for p, c in zip(prompts, completions, strict=True)],
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        return self.model(**encoded).logits.float().softmax(-1)[:, self.index].tolist()


@dataclass
class Rollout(RowBatch):
    """A micro-batch's prompts after the rollout: each prompt's group of ``group`` sampled
    completions as training rows (prompt + completion, only the completion labelled) and each
    completion's advantage [rows] (float64, on the host until moved). It counts and cuts by
    prompts, as the batch of prompts it came from did."""

    rows: TokenBatch
    advantages: torch.Tensor
    group: int

    def __len__(self) -> int:
        return len(self.rows) // self.group

    @property
    def count(self) -> int:
        return len(self)

    @property
    def tokens(self) -> int:
        return self.rows.tokens

    def to(self, device: torch.device, non_blocking: bool = True) -> Rollout:
        return Rollout(
            self.rows.to(device, non_blocking), self.advantages.to(device, non_blocking=non_blocking), self.group
        )

    def pin_memory(self) -> Rollout:
        return Rollout(self.rows.pin_memory(), self.advantages.pin_memory(), self.group)

    def split_rows(self, size: int) -> list[Rollout]:
        rows = size * self.group
        pieces = self.rows.split_rows(rows)
        return [
            Rollout(piece, self.advantages[i * rows : (i + 1) * rows], self.group) for i, piece in enumerate(pieces)
        ]


class GRPOLoss:
    """``rollout(model, prompts, micro_batch_size)``: the job's phase before each step, which
    samples and scores each prompt's completions; ``loss(model, rollout)``: the GRPO loss of a
    micro-batch of them (mean over its completions), an ordinary forward of whatever layout the
    model has; ``metrics`` reports the interval's rewards, lengths and generation time."""

    def __init__(self, cfg: Config, family: ModelFamily, tokenizer: Any, reward: Callable, world: World):
        self.g, self.family, self.tokenizer, self.reward, self.world = cfg.grpo, family, tokenizer, reward, world
        self.kl = cfg.grpo.kl_coef > 0
        # METRICS' sums but the KL's, the generation seconds and the completions: host values
        # (rewards are); the KL's sum stays on the device, read when the metrics are.
        self.sums = torch.zeros(len(METRICS) + 2, dtype=torch.float64)
        self.kl_sum: torch.Tensor | None = None

    def rollout(self, model: nn.Module, batch: PromptBatch, micro_batch_size: int) -> Rollout:
        """Each prompt's group of completions, sampled by ``model`` (this rank's, unwrapped: the
        whole model) a micro-batch of prompts at a time, scored, with their advantages."""
        g = self.g
        started = time.perf_counter()
        sampled, advantages = [], []
        for piece in batch.split_rows(micro_batch_size):
            completions = self.sample(model, piece)
            rewards = self.score(piece, completions)
            grouped = rewards.view(len(piece), g.group_size)
            advantage = grouped - grouped.mean(1, keepdim=True)
            if g.scale_rewards:
                advantage = advantage / (grouped.std(1, keepdim=True) + 1e-4)
            sampled += completions
            advantages.append(advantage.flatten())
            ended = [c[-1] == self.tokenizer.eos_token_id for c in completions]
            self.sums[:4] += torch.tensor(
                [
                    rewards.sum().item(),
                    grouped.std(1).sum().item() * g.group_size,
                    float(sum(map(len, completions))),
                    float(len(ended) - sum(ended)),
                ],
                dtype=torch.float64,
            )
            self.sums[-1] += len(completions)
        self.sums[-2] += time.perf_counter() - started
        device = next(p.device for p in model.parameters())
        rows = self.rows(batch.prompt_ids, sampled)
        return Rollout(rows, torch.cat(advantages), g.group_size).to(device)

    def __call__(self, model: nn.Module, batch: Rollout) -> torch.Tensor:
        g, rows = self.g, batch.rows
        logps, scored = token_logps(model, rows)
        # The ratio to the policy that sampled (this one): 1, with the gradient of log p.
        ratio = torch.exp(logps - logps.detach())
        per_token = -ratio * batch.advantages.to(dtype=logps.dtype)[:, None]
        if self.kl:
            with torch.no_grad(), adapters_disabled(model):
                ref, _ = token_logps(model, rows)
            log_ratio = ref - logps
            k3 = torch.exp(log_ratio) - log_ratio - 1  # unbiased and never negative
            per_token = per_token + g.kl_coef * k3
            kl = (k3 * scored).sum() / scored.sum().clamp(min=1)
            total = kl.detach().double() * len(rows)
            self.kl_sum = total if self.kl_sum is None else self.kl_sum + total
        lengths = scored.sum(1)
        norm = lengths.clamp(min=1) if g.length_norm == "sequence" else torch.full_like(lengths, g.max_new_tokens)
        return ((per_token * scored).sum(1) / norm).mean()

    @torch.no_grad()
    def sample(self, model: nn.Module, batch: PromptBatch, greedy: bool = False) -> list[list[int]]:
        """Each prompt's group of completions (one greedy completion each with ``greedy``), in
        order, as token lists (up to and including the end-of-text token, when they reach one)."""
        g, eos = self.g, self.tokenizer.eos_token_id
        decodable = self.family.decoding(model)
        if decodable is None:
            raise ConfigError([f"run.job: grpo samples from the model, which {self.family.name} models cannot"])
        # One draw from the global generator (identical on every rank, and in checkpoints) seeds
        # this micro-batch's sampling; the rank and the row make the rows' seeds differ.
        seed = int(torch.randint(2**62, (1,)).item()) + self.world.rank * 2**40
        group = 1 if greedy else g.group_size
        temperature = 0.0 if greedy else g.temperature
        top_p = None if greedy else g.top_p
        prompts = [prompt for prompt in batch.prompt_ids for _ in range(group)]
        rows = [
            Row(prompt, g.max_new_tokens, Sampling(temperature, None, top_p, seed + i), eos)
            for i, prompt in enumerate(prompts)
        ]
        # Every completion a row of one batch, whatever the prompts' lengths; a group's rows share
        # their prompt's prefill.
        Decoder(decodable, max_batch=len(rows), max_batch_tokens=max(512, len(rows))).run(rows)
        return [row.tokens for row in rows]

    def rows(self, prompt_ids: list[list[int]], completions: list[list[int]]) -> TokenBatch:
        """Training rows of each prompt's group of ``completions`` (in order): prompt +
        completion, only the completion labelled, padded on the right."""
        group = len(completions) // len(prompt_ids)
        prompts = [prompt_ids[i // group] for i in range(len(completions))]
        ids = [p + c for p, c in zip(prompts, completions, strict=True)]
        labels = [[IGNORE_INDEX] * len(p) + c for p, c in zip(prompts, completions, strict=True)]
        lengths = [len(r) for r in ids]
        return TokenBatch(
            input_ids=pad_rows(ids, pad_id(self.tokenizer)),
            labels=pad_rows(labels, IGNORE_INDEX),
            attention_mask=pad_rows([[1] * n for n in lengths], 0),
            lengths=lengths,
            loss_tokens=[len(c) for c in completions],
        )

    def score(self, batch: PromptBatch, completions: list[list[int]], group: int | None = None) -> torch.Tensor:
        """The reward function's values [completions], float64 on the host."""
        group = group or self.g.group_size
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        prompts = [p for p in batch.prompts for _ in range(group)]
        names = {k for f in batch.fields for k in f}
        fields = {k: [f.get(k) for f in batch.fields for _ in range(group)] for k in names}
        values = self.reward(prompts=prompts, completions=texts, **fields)
        if len(values) != len(texts):
            raise ValueError(f"grpo.reward: returned {len(values)} rewards for {len(texts)} completions")
        return torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float64)

    def metrics(self, world: World) -> dict[str, float]:
        """The interval's means over its completions and its seconds of sampling (averaged over
        the ranks), and a new interval. The rest of the interval's time is training."""
        if not self.sums[-1]:
            return {}
        local = self.sums.to(world.device)
        if self.kl_sum is not None:
            local[METRICS.index("kl")] = self.kl_sum.to(world.device)
        sums = world.mean(local).tolist()
        self.sums, self.kl_sum = torch.zeros_like(self.sums), None
        out = {name: v / sums[-1] for name, v in zip(METRICS, sums, strict=False)}
        out["time/generation_s"] = sums[-2]
        return out

    def evaluate(self, model: nn.Module, batches: list[PromptBatch]) -> dict[str, float]:
        """``val_reward``: the mean reward of one greedy completion of each validation prompt, and
        ``val_completions/mean_length``."""
        rewards, lengths = [], []
        for batch in batches:
            completions = self.sample(model, batch, greedy=True)
            rewards.append(self.score(batch, completions, group=1))
            lengths += [len(c) for c in completions]
        if not lengths:
            return {}
        return {
            "val_reward": torch.cat(rewards).mean().item(),
            "val_completions/mean_length": sum(lengths) / len(lengths),
        }
