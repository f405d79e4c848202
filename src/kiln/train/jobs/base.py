"""What a job is: everything about one kind of run that the generic loop does not know.

A job owns the way from the config to the data and the model (through the model family), the
loss, what evaluation measures, what sampling shows and what the run directory holds besides
what the loop writes. The ``Trainer`` asks it for these and knows nothing else of the run's
kind; ``kiln eval``, ``generate``, ``export``, ``serve``, ``doctor``, ``plan`` and ``sweep`` get
the same job from the same config (``kiln.train.jobs.job_for``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from kiln.checkpoint import Stateful
from kiln.config import Config
from kiln.data import PreparedData
from kiln.distributed.world import World
from kiln.models.family import ModelFamily, ParallelPlan, build_model, family_of
from kiln.models.init import Values, params_on_meta
from kiln.train.apply import apply_lora
from kiln.train.precision import Precision


@dataclass(frozen=True)
class EvalContext:
    """What an evaluation is handed: the step it follows, the device, the micro-batch size in use
    (the out-of-memory ladder may have lowered the config's) and the run's precision (evaluation
    already runs under its autocast, in eval mode, without gradients)."""

    step: int
    device: torch.device
    micro_batch_size: int
    precision: Precision


class ValidationRows(NamedTuple):
    """Validation inputs of a saved run as token ids, unpadded (what an export is checked on):
    ``ids`` rows, ``labels`` (a classifier's class ids, else None), and where they came from."""

    ids: list[list[int]]
    labels: list[int] | None
    source: str


class Job:
    """One kind of run. ``prepare`` readies the data and the model's arguments; after it, the job
    has ``train_data`` (a Dataset), ``collate_fn`` (items to a batch), ``loss_fn`` (``loss_fn(model,
    batch)``: the mean loss of a micro-batch), ``tokens_per_sample``, ``flops_per_token`` (None
    where unknown: no MFU) and ``plan`` (the model's ParallelPlan). ``model()`` may return a model
    on the ``meta`` device, and then sets ``initial``."""

    train_data: Dataset
    collate_fn: Callable[[list], Any] = staticmethod(default_collate)
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    tokens_per_sample: int = 1
    flops_per_token: float | None = None
    # Consecutive optimizer steps each batch of the data serves (GRPO's grpo.iterations: the
    # steps that train on one rollout of its prompts).
    repeat: int = 1
    plan: ParallelPlan
    # The tokenizer the job's text is encoded with: a tokenizers.Tokenizer (kiln's own) or the
    # model's transformers tokenizer; None where the job has no text.
    tokenizer: Any = None
    # Set by ``model`` when it returns a model on ``meta``: its initial values, which each rank
    # writes into the shards it holds once the layout is applied.
    initial: Values | None = None

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def whole_model(self, device: torch.device) -> nn.Module:
        """The model a run starts from, whole on ``device``, in one process (the doctor's)."""
        model = self.model()
        if self.initial is None:
            return model.to(device)
        self.initial.materialize(model, device)
        return model

    def prepare(self, world: World, console: bool) -> None:
        """Ready the data and the model's arguments on this rank (raises ConfigError or DataError
        on bad input, before anything is written)."""
        raise NotImplementedError

    def prepare_data(self, world: World, console: bool) -> dict[str, PreparedData]:
        """What ``kiln prepare`` caches ahead of training, as ``prepare`` then reads it: the
        tokenized corpus (by the name "") or each source of a mixture, each rank tokenizing its
        share of the files. Nothing for a job that reads its records into memory as it starts."""
        return {}

    def model(self) -> nn.Module:
        """The model to train, on the CPU, initialised from ``train.seed`` (or pretrained)."""
        raise NotImplementedError

    def rollout(self, model: nn.Module, batch: Any, micro_batch_size: int, step: int) -> Any:
        """(1-based) ``step``'s batch as the loss takes it: a phase before the step, with the
        layout's forward of whole rows (``ParallelModel.eval_forward``: this rank's unwrapped
        module, or a pipeline's stages in turn; e.g. GRPO samples and scores its prompts'
        completions here, so that its loss is an ordinary forward of whatever layout the model
        has). As given by default."""
        return batch

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """The job's own state that the run's checkpoints keep beside the loop's, by name (each
        part's ``state_dict`` is asked for on every rank together, so it may gather over them);
        it is restored with the rest at a resume or a rollback, and put back after the time
        plan's probe. None by default."""
        return {}

    def evaluate(self, model: nn.Module, ctx: EvalContext) -> dict[str, Any] | None:
        """Validation metrics (None: the job has none)."""
        return None

    def metrics(self, world: World) -> dict[str, float]:
        """The job's own training metrics of the log interval ending now (on every rank: it may
        reduce over them), e.g. a preference objective's rewards; a new interval starts."""
        return {}

    def sample(self, model: nn.Module, ctx: EvalContext) -> str | None:
        """Text to show at an evaluation (a generated sample), or None."""
        return None

    def describe(self, model: nn.Module) -> list[str]:
        """Lines for the console about the model and the data."""
        return []

    def write_files(self, run_dir: Path) -> None:
        """What the run directory holds of this job beside the loop's files (rank 0, once prepared)."""


class FamilyJob(Job):
    """A job whose model is built through a model family (``model.family``: kiln's GPT, a
    plug-in, a Hugging Face model) from ``args``, the family's resolved arguments, which its run
    directory records (``model.json``): so a kiln command can build the model of a saved run
    again (``kiln.train.run.load_run``)."""

    args: Any

    def family_model(self, args: Any) -> nn.Module:
        """The family's model of ``args`` that a run starts from, with LoRA adapters if asked for.

        Built on ``meta``, with ``initial`` set, when the family gives each tensor's starting
        value by name (kiln's GPT from the seed, a Hugging Face model from its safetensors): each
        rank then allocates and writes only what it holds (``kiln.distributed.parallelize``), and
        no rank ever holds the whole model. Otherwise, and for a 4-bit base (quantized whole),
        created whole on the CPU on every rank."""
        family, cfg = self.family, self.cfg
        if cfg.lora.quantize_base == "none":
            with params_on_meta():
                model = apply_lora(family.build(args), cfg, family, args)
            self.initial = family.initial_values(args, model, cfg.train.seed)
            if self.initial is not None:
                return model
        return apply_lora(family.create(args, "cpu", cfg.train.seed), cfg, family, args)

    @functools.cached_property
    def family(self) -> ModelFamily:
        return family_of(self.cfg.model)

    # -- a saved run (kiln eval, generate, export, serve) ----------------------------------------

    def saved_model(self, directory: Path) -> tuple[Any, nn.Module]:
        """The model arguments a run (or a safetensors export) recorded in ``model.json``, and the
        model they describe, freshly initialised on the CPU, to load weights into."""
        family = self.family
        args = family.args_from_dict(json.loads((directory / "model.json").read_text()))
        model = build_model(family, args, "cpu", self.cfg.train.seed)
        # A QLoRA base is loaded as the checkpoint holds it, dequantized: what the run computed, exactly.
        return args, apply_lora(model, self.cfg, family, args, quantize=False)

    def saved_skeleton(self, directory: Path) -> tuple[Any, nn.Module]:
        """``saved_model`` without storage: its parameters on ``meta`` (buffers real), in eval mode,
        for a caller that fills only the parts it reads (an export of a sharded run)."""
        family = self.family
        args = family.args_from_dict(json.loads((directory / "model.json").read_text()))
        with params_on_meta():
            model = apply_lora(family.build(args), self.cfg, family, args, quantize=False)
        return args, model.eval()

    def validation_rows(self, tokenizer: Any, run_dir: Path, rows: int) -> ValidationRows:
        """Up to ``rows`` of the run's validation inputs, as the job reads them, tokenized by
        ``tokenizer`` (the saved run's, in ``run_dir``)."""
        raise NotImplementedError

    def saved_tokenizer(self, directory: Path) -> Any:
        """The tokenizer a run (or a safetensors export) wrote into ``directory``."""
        raise NotImplementedError

    def evaluate_saved(
        self, run: LoadedRun, *, source: str | None, max_batches: int | None, batch_size: int | None
    ) -> dict[str, Any]:
        """``kiln eval``: the job's metrics of a saved model, on its run's validation split or on
        every item of ``source``."""
        raise NotImplementedError


@dataclass
class LoadedRun:
    """A saved model with what it needs to be used (``kiln.train.run.load_run``), in eval mode."""

    cfg: Config
    job: FamilyJob
    family: ModelFamily  # the job's
    args: Any
    model: nn.Module
    tokenizer: Any  # a tokenizers.Tokenizer (kiln's own), or the model's transformers tokenizer
    checkpoint: Path
    step: int
    directory: Path  # the run directory, or the export directory it was loaded from
