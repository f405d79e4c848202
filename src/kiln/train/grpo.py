"""GRPO (Shao et al. 2024): reinforcement learning with verifiable rewards. For each prompt of a
batch the model samples a group of completions with kiln's batched decoder, reward functions
(weighed, summed) score them, and each completion's advantage is its reward against its group's;
the loss raises the log-probability of the completion's tokens in proportion to it (optionally
minus a KL estimate to the reference model, the model with its LoRA adapters off), its token
losses averaged as grpo.loss says (grpo, dr_grpo, dapo, bnpo).

Sampling is the job's rollout, a phase of the loop before each step (``Job.rollout``) that turns
the step's prompts into scored completions (a ``Rollout``), so the loss is an ordinary forward of
whatever layout the model has. The loss is the clipped surrogate of PPO: each token's ratio of
its probability to the sampling policy's, clipped to [1 - grpo.epsilon, 1 + grpo.epsilon_high]
where the advantage would push it further. With grpo.iterations = 1 (the default) each group of
completions is sampled and trained on in one step, so the ratio is exactly 1 (on-policy, as TRL
with one iteration per generation); with more, the completions serve that many consecutive steps
(a cycle: the data gives them the same prompts, so none is skipped), the sampling policy's
log-probabilities of them taken at the first, and the ratio moves off 1 at the later ones (TRL's
num_iterations). The rollout kept for a cycle is part of the run's checkpoints, and sampling
draws its seed from the global torch generator, which they keep too, so a resumed run samples
and trains on what the uninterrupted one did. Generation and training time are reported apart.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import Config, ConfigError
from kiln.config.schema import GRPOConfig
from kiln.data.batch import RowBatch, TokenBatch, next_labels, pad_id, pad_rows
from kiln.data.prompts import PromptBatch
from kiln.distributed.parallel import Staged
from kiln.distributed.world import World
from kiln.labels import IGNORE_INDEX
from kiln.models.decode import Decoder, Row, Sampling
from kiln.models.family import ModelFamily
from kiln.models.hf.loading import read_config
from kiln.train.logps import token_logps
from kiln.train.precision import autocast
from kiln.train.preference import adapters_disabled, pad_to

# Means over the log interval's sampled completions.
SAMPLED = ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio")


def load_reward(spec: str, key: str = "grpo.reward") -> Callable[..., list[float | None]]:
    """The function ``package.module:function`` names (ConfigError naming ``key`` if not)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError([f"{key}: {spec!r} is not package.module:function"])
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError([f"{key}: cannot import {spec}: {e}"]) from None
    if not callable(function):
        raise ConfigError([f"{key}: {spec} is not callable"])
    return function


class Rewards:
    """The run's reward functions, each with a name (its function's, as TRL logs them) and a
    weight: called as one reward function is, it returns each completion's weighted sum [n] and
    each function's values [functions, n], float64 on the host."""

    def __init__(self, functions: list[tuple[str, Callable[..., Any]]], weights: Sequence[float] = ()):
        self.names = [
            name if [n for n, _ in functions].count(name) == 1 else f"{name}_{i}"
            for i, (name, _) in enumerate(functions)
        ]
        self.functions = [f for _, f in functions]
        self.weights = torch.tensor(list(weights) or [1.0] * len(functions), dtype=torch.float64)

    @classmethod
    def of(cls, g: GRPOConfig, device: torch.device) -> Rewards:
        """grpo.reward or grpo.rewards, then grpo.reward_model, weighed by grpo.reward_weights."""
        key = "grpo.rewards" if g.rewards else "grpo.reward"
        specs = list(g.rewards) or ([g.reward] if g.reward else [])
        functions: list[tuple[str, Callable[..., Any]]] = [(s.partition(":")[2], load_reward(s, key)) for s in specs]
        if g.reward_model:
            functions.append(("reward_model", RewardModel(g.reward_model, g.reward_label, device)))
        return cls(functions, g.reward_weights)

    def __call__(
        self, prompts: list[Any], completions: list[str], **fields: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values = []
        for name, function in zip(self.names, self.functions, strict=True):
            out = function(prompts=prompts, completions=completions, **fields)
            if len(out) != len(completions):
                raise ValueError(f"reward {name}: returned {len(out)} rewards for {len(completions)} completions")
            values.append([0.0 if v is None else float(v) for v in out])
        each = torch.tensor(values, dtype=torch.float64)
        return (self.weights[:, None] * each).sum(0), each


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
    completions as training rows (prompt + completion, only the completion labelled), each
    completion's advantage [rows] (float64, on the host until moved) and, where the completions
    serve several steps (grpo.iterations), the log-probabilities [rows, length - 1] that the
    policy which sampled them gave their tokens (``token_logps``'), which the loss's ratio is
    taken against. It counts and cuts by prompts, as the batch of prompts it came from did."""

    rows: TokenBatch
    advantages: torch.Tensor
    group: int
    by_tokens: bool = False  # grpo.loss = dapo: every completion token weighs the same
    old_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows) // self.group

    @property
    def count(self) -> int:
        return sum(self.rows.loss_tokens or ()) if self.by_tokens else len(self)

    @property
    def tokens(self) -> int:
        return self.rows.tokens

    def _map(self, rows: TokenBatch, fn: Callable[[torch.Tensor], torch.Tensor], at: slice = slice(None)) -> Rollout:
        """This rollout's rows ``at`` as ``rows``, its tensors' by ``fn``; the old log-probabilities
        cut to the width of ``rows`` too."""
        old = None if self.old_logps is None else fn(self.old_logps[at, : rows.input_ids.shape[1] - 1])
        return Rollout(rows, fn(self.advantages[at]), self.group, self.by_tokens, old)

    def to(self, device: torch.device, non_blocking: bool = True) -> Rollout:
        return self._map(self.rows.to(device, non_blocking), lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Rollout:
        return self._map(self.rows.pin_memory(), torch.Tensor.pin_memory)

    def split_rows(self, size: int) -> list[Rollout]:
        rows = size * self.group
        pieces = self.rows.split_rows(rows)
        return [self._map(piece, lambda t: t, slice(i * rows, (i + 1) * rows)) for i, piece in enumerate(pieces)]


class KeptRollout:
    """The rollout that the steps of one cycle of grpo.iterations train on (``cycle``: which, from
    0; -1 for none), kept from the cycle's first step until its last. A part of the run's
    checkpoints (``Job.checkpoint_parts``), so that a run resumed within a cycle trains on the
    completions the uninterrupted one did. Each rank samples its own, and only the main rank writes
    this state: ``state_dict`` gathers every rank's (on the host), ``load_state_dict`` takes back
    this rank's; none where the number of ranks changed (their prompts did), and the cycle's later
    steps then sample afresh."""

    def __init__(self, world: World):
        self.world = world
        self.rollout: Rollout | None = None
        self.cycle = -1

    def state_dict(self) -> dict:
        mine = None if self.rollout is None else asdict(self.rollout.to(torch.device("cpu"), non_blocking=False))
        return {"cycle": self.cycle, "ranks": self.world.gather(mine)}

    def load_state_dict(self, state: dict) -> None:
        ranks = state["ranks"]
        mine = ranks[self.world.rank] if len(ranks) == self.world.size else None
        if mine is None:
            self.rollout, self.cycle = None, -1
            return
        self.rollout = Rollout(**{**mine, "rows": TokenBatch(**mine["rows"])}).to(self.world.device)
        self.cycle = state["cycle"]


class GRPOLoss:
    """``rollout(model, prompts, micro_batch_size, step)``: the job's phase before each step,
    which samples and scores each prompt's completions (or takes those its cycle of
    grpo.iterations sampled); ``loss(model, rollout)``: the GRPO loss of a micro-batch of them (as
    grpo.loss says), an ordinary forward of whatever layout the model has; ``metrics`` reports the
    interval's rewards, lengths, generation time and what the loss clipped."""

    def __init__(self, cfg: Config, family: ModelFamily, tokenizer: Any, rewards: Rewards, world: World):
        self.g, self.family, self.tokenizer, self.rewards, self.world = cfg.grpo, family, tokenizer, rewards, world
        self.width = cfg.data.seq_len  # what pipeline stages pad the rows to (``staged``)
        self.kl, self.precision = cfg.grpo.kl_coef > 0, cfg.train.precision
        self.kept = KeptRollout(world)
        # SAMPLED's sums, the generation seconds, the completions sampled and those trained on:
        # host values (rewards are). Each reward function's sum and sum of squares. On the
        # device, read when the metrics are: the KL's sum over the completion tokens trained on and
        # their number, and the tokens whose ratio was clipped and all of them.
        self.sums = torch.zeros(len(SAMPLED) + 3, dtype=torch.float64)
        self.each = torch.zeros(len(rewards.names), 2, dtype=torch.float64)
        self.kl_sum: torch.Tensor | None = None
        self.clip_sum: torch.Tensor | None = None

    def rollout(self, model: nn.Module, batch: PromptBatch, micro_batch_size: int, step: int) -> Rollout:
        """(1-based) ``step``'s completions: sampled, scored and given their advantages at the
        first step of each cycle of grpo.iterations steps (whose batches hold the same prompts),
        and kept with the sampling policy's log-probabilities of them for the cycle's other
        steps, which train on them again."""
        iterations, kept = self.g.iterations, self.kept
        cycle = (step - 1) // iterations
        if cycle == kept.cycle and kept.rollout is not None:
            rollout = kept.rollout
            if step % iterations == 0:  # the cycle's last step: a checkpoint after it need not keep it
                kept.rollout = None
            return rollout
        rollout = self._scored(model, batch, micro_batch_size)
        # Kept where later steps of the cycle will reuse it; a step of an earlier cycle rolled out
        # again (the guard's replay of a bad step) keeps nothing. Non-finite log-probabilities on
        # any rank would make every later step of the cycle non-finite, a rollback into it too:
        # those steps sample afresh instead, on every rank alike.
        if step % iterations and cycle > kept.cycle:
            old = self._logps(model, rollout, micro_batch_size)
            (non_finite,) = self.world.agree(not torch.isfinite(old).all().item())
            if not non_finite:
                rollout = replace(rollout, old_logps=old)
                kept.rollout, kept.cycle = rollout, cycle
        return rollout

    def _scored(self, model: nn.Module, batch: PromptBatch, micro_batch_size: int) -> Rollout:
        """Each prompt's group of completions, sampled by ``model`` (this rank's, unwrapped: the
        whole model) as rows of the decoder, the groups of at most ``micro_batch_size`` prompts
        decoding at once (what the step's forward holds, so the memory ladder's micro-batch also
        bounds sampling's cache), scored, with their advantages."""
        g = self.g
        started = time.perf_counter()
        completions = self.sample(model, batch, micro_batch_size)
        prompts, texts, fields = self._texts(batch, completions)
        rewards, each = self.rewards(prompts, texts, **fields)
        grouped = rewards.view(len(batch), g.group_size)
        advantage = grouped - grouped.mean(1, keepdim=True)
        if g.scale_rewards:
            advantage = advantage / (grouped.std(1, keepdim=True) + 1e-4)
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
        self.each += torch.stack([each.sum(1), each.square().sum(1)], dim=1)
        self.sums[-2] += len(completions)
        self.sums[-3] += time.perf_counter() - started
        device = next(p.device for p in model.parameters())
        rows = self.rows(batch.prompt_ids, completions)
        return Rollout(rows, advantage.flatten(), g.group_size, by_tokens=g.loss == "dapo").to(device)

    @torch.no_grad()
    def _logps(self, model: nn.Module, rollout: Rollout, micro_batch_size: int) -> torch.Tensor:
        """The log-probabilities [rows, length - 1] ``model`` gives the rollout's tokens, computed
        as the loss computes them (in its micro-batches, under the run's precision), so that the
        ratio is exactly 1 at the step that sampled them; at most a micro-batch held at once."""
        width = rollout.rows.input_ids.shape[1] - 1
        with autocast(self.precision, rollout.advantages.device):
            pieces = [token_logps(model, piece.rows)[0] for piece in rollout.split_rows(micro_batch_size)]
        return torch.cat([nn.functional.pad(p, (0, width - p.shape[1])) for p in pieces])

    def __call__(self, model: nn.Module, batch: Rollout) -> torch.Tensor:
        logps, scored = token_logps(model, batch.rows)
        return self._loss(logps, scored, batch.advantages, batch.old_logps, self._reference(model, batch.rows))

    def _reference(self, model: nn.Module, rows: TokenBatch) -> torch.Tensor | None:
        """The KL's reference log-probabilities of ``rows``: the model's with its adapters off."""
        if not self.kl:
            return None
        with torch.no_grad(), adapters_disabled(model):
            return token_logps(model, rows)[0]

    def _loss(
        self,
        logps: torch.Tensor,
        scored: torch.Tensor,
        advantages: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> torch.Tensor:
        """The loss of rows whose tokens' log-probabilities are ``logps`` [rows, T] (``scored``
        those that count), given each row's advantage, the log-probabilities of the policy that
        sampled them (None: this one) and of the reference (None: no KL)."""
        g = self.g
        # The ratio to the policy that sampled: the one kept with completions that serve several
        # steps, else this one (1, with the gradient of log p).
        ratio = torch.exp(logps - (logps.detach() if old is None else old))
        advantages = advantages.to(dtype=logps.dtype)[:, None]
        low, high = 1 - g.epsilon, 1 + (g.epsilon_high or g.epsilon)
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
        self.sums[-1] += len(logps)
        if old is not None:
            # The tokens whose gradient the clip takes away: past the band where the advantage pushes.
            clipped = ((ratio < low) & (advantages < 0) | (ratio > high) & (advantages > 0)) & scored
            counts = torch.stack([clipped.sum(), scored.sum()]).double()
            self.clip_sum = counts if self.clip_sum is None else self.clip_sum + counts
        if ref is not None:
            log_ratio = ref - logps
            k3 = torch.exp(log_ratio) - log_ratio - 1  # unbiased and never negative
            per_token = per_token + g.kl_coef * k3
            # Summed by token, so that the mean is the same however the rows are cut (pipeline pieces).
            total = torch.stack([(k3 * scored).sum().detach(), scored.sum()]).double()
            self.kl_sum = total if self.kl_sum is None else self.kl_sum + total
        losses = per_token * scored
        if g.loss in ("dapo", "bnpo"):  # a mean over tokens (the step weighs dapo's by tokens)
            return losses.sum() / scored.sum().clamp(min=1)
        lengths = scored.sum(1)
        norm = lengths.clamp(min=1) if g.loss == "grpo" else torch.full_like(lengths, g.max_new_tokens)
        return (losses.sum(1) / norm).mean()

    def staged(self, model: nn.Module, batch: Rollout) -> Staged:
        """The rollout as pipeline stages take it: its rows padded to ``data.seq_len`` (one shape
        every step), the last stage giving each token's log-probability; the target holds each
        row's advantage, which tokens are scored, the sampling policy's log-probabilities (where
        kept) and the reference's, computed first with ``model``, the pipeline's forward. The
        schedule's pieces weigh by rows, or by scored tokens where the loss is a mean over them."""
        rows, width = batch.rows, self.width
        wide = TokenBatch(
            pad_to(rows.input_ids, width, 0),
            pad_to(rows.labels, width, IGNORE_INDEX),
            pad_to(rows.attention_mask, width, 0),
        )
        targets = next_labels(wide.labels)
        scored = targets != IGNORE_INDEX
        with autocast(self.precision, targets.device):
            ref = self._reference(model, wide)
        zeros = torch.zeros(scored.shape, device=targets.device)
        old = zeros if batch.old_logps is None else pad_to(batch.old_logps, width, 0)
        ref = zeros if ref is None else pad_to(ref, width, 0)
        target = torch.cat([batch.advantages.float()[:, None], scored.float(), old.float(), ref.float()], 1)
        keywords = {"targets": targets, "attention_mask": wide.attention_mask, "token_logps": True}
        kept, kl = batch.old_logps is not None, self.kl

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            advantages, scored, old, ref = target[:, 0], *target[:, 1:].chunk(3, dim=1)
            return self._loss(output, scored.bool(), advantages, old if kept else None, ref if kl else None)

        by_tokens = self.g.loss in ("dapo", "bnpo")

        def count(target: torch.Tensor) -> torch.Tensor:
            return target[:, 1 : 1 + width].sum() if by_tokens else target.new_tensor(len(target))

        return Staged(wide.input_ids, target, keywords, loss, count=count)

    @torch.no_grad()
    def sample(
        self, model: nn.Module, batch: PromptBatch, prompts_at_once: int | None = None, greedy: bool = False
    ) -> list[list[int]]:
        """Each prompt's group of completions (one greedy completion each with ``greedy``), in
        order, as token lists (up to and including the end-of-text token, when they reach one);
        the completions of at most ``prompts_at_once`` prompts (all: None) decoding at once."""
        g, eos = self.g, self.tokenizer.eos_token_id
        decodable = self.family.decoding(model)
        if decodable is None:
            raise ConfigError([f"run.job: grpo samples from the model, which {self.family.name} models cannot"])
        group = 1 if greedy else g.group_size
        temperature = 0.0 if greedy else g.temperature
        top_p = None if greedy else g.top_p
        # One draw from the global generator (identical on every rank, and in checkpoints) seeds
        # this batch's sampling, each row's seed offset by its index in the global batch (this
        # rank's rows follow those of the data ranks before it; a CPU generator keeps only a
        # seed's low 32 bits, so offsets must be small), and a row's tokens do not depend on the
        # rows decoded beside it: the ranks sample what one process would.
        seed = int(torch.randint(2**62, (1,)).item()) + self.world.data_rank * len(batch) * group
        prompts = [prompt for prompt in batch.prompt_ids for _ in range(group)]
        rows = [
            Row(prompt, g.max_new_tokens, Sampling(temperature, None, top_p, seed + i), eos)
            for i, prompt in enumerate(prompts)
        ]
        # Completions of any prompts' lengths decode together, rows joining as others end; a
        # group's rows share their prompt's prefill. A sharded model's forward passes gather
        # their layers from every rank: the ranks run as many, in step (over the host's group;
        # alone, largest is the value itself).
        decoder = Decoder(decodable, max_batch=min(len(rows), (prompts_at_once or len(batch)) * group))
        decoder.run(rows, lockstep=self.world.largest)
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

    def _texts(
        self, batch: PromptBatch, completions: list[list[int]]
    ) -> tuple[list[Any], list[str], dict[str, list[Any]]]:
        """What the reward functions are given: each completion's prompt and text, and the
        records' other fields (as keywords), one entry per completion."""
        group = len(completions) // len(batch)
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        prompts = [p for p in batch.prompts for _ in range(group)]
        names = {k for f in batch.fields for k in f}
        fields = {k: [f.get(k) for f in batch.fields for _ in range(group)] for k in names}
        return prompts, texts, fields

    def metrics(self, world: World) -> dict[str, float]:
        """The interval's means over its sampled completions and its seconds of sampling
        (averaged over the ranks), each reward function's mean and standard deviation (where it
        sampled: with grpo.iterations > 1 not every step does); the KL's mean over the
        completion tokens trained on and, with grpo.iterations > 1, ``clip_ratio``, the share of
        them whose ratio was clipped; and a new interval. The rest of the interval's time is
        training. Every rank reduces, whatever it counted: pipeline stages before the last
        compute no loss, so they count no completion trained on."""
        # The KL's sum and its tokens, the clipped tokens and all.
        trained = torch.zeros(4, dtype=torch.float64, device=world.device)
        if self.kl_sum is not None:
            trained[:2] = self.kl_sum
        if self.clip_sum is not None:
            trained[2:] = self.clip_sum
        local = torch.cat([self.sums.to(world.device), self.each.flatten().to(world.device), trained])
        everything = world.mean(local).tolist()
        sums, each, (kl, kl_tokens, clipped, tokens) = (
            everything[: len(self.sums)],
            everything[len(self.sums) : -4],
            everything[-4:],
        )
        self.sums, self.each = torch.zeros_like(self.sums), torch.zeros_like(self.each)
        self.kl_sum = self.clip_sum = None
        if not (sums[-2] or sums[-1]):
            return {}
        out = {"kl": kl / kl_tokens if kl_tokens else 0.0} if sums[-1] else {}
        if self.g.iterations > 1 and tokens:
            out["clip_ratio"] = clipped / tokens
        if not (n := sums[-2]):
            return out
        out.update({name: v / n for name, v in zip(SAMPLED, sums, strict=False)})
        out["time/generation_s"] = sums[-3]
        for i, name in enumerate(self.rewards.names):
            mean = each[2 * i] / n
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = max(each[2 * i + 1] / n - mean * mean, 0.0) ** 0.5
        return out

    def evaluate(self, model: nn.Module, batches: list[PromptBatch]) -> dict[str, float]:
        """``val_reward``: the mean reward of one greedy completion of each validation prompt, and
        ``val_completions/mean_length``."""
        rewards, lengths = [], []
        for batch in batches:
            completions = self.sample(model, batch, greedy=True)  # batches of one micro-batch
            prompts, texts, fields = self._texts(batch, completions)
            rewards.append(self.rewards(prompts, texts, **fields)[0])
            lengths += [len(c) for c in completions]
        if not lengths:
            return {}
        return {
            "val_reward": torch.cat(rewards).mean().item(),
            "val_completions/mean_length": sum(lengths) / len(lengths),
        }
