"""What ``kiln doctor`` examines, its ``Subject``: the job of a config (prepared data, the model
family's model and loss), or a user's own model, loss and datasets. The checks share work through
the subject (``shared``), so that, say, the data scan several data checks use runs once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from kiln.config import Config, ConfigError
from kiln.data import DataError, PreparedData, TokenSequences
from kiln.data.finetune import FineTuneData
from kiln.data.tokenizer import eot_id
from kiln.device import resolve_device, resolve_precision
from kiln.distributed.world import World
from kiln.models.family import build_model
from kiln.train.jobs import FineTuneJob, job_for
from kiln.train.step import LossFn

T = TypeVar("T")


@dataclass
class Subject:
    """Everything the checks look at. Models come from ``new_model`` so that every check starts
    from the same untrained weights and none of them changes the user's model."""

    cfg: Config
    device: torch.device
    device_problem: str | None
    new_model: Callable[[], nn.Module] | None
    loss_fn: LossFn
    train_data: Dataset | None
    val_data: Dataset | None
    tokenizer: Any
    eot: int | None
    vocab_size: int | None
    num_params: int
    head_dim: int | None
    prepared: PreparedData | None = None
    data_problem: str | None = None
    """Why there is no data to check (preparing it failed), or None."""
    source: str = ""
    """What data is checked, in words."""
    collate_fn: Callable[[list], Any] = default_collate
    """How items become a batch (a fine-tuning job's pads rows into a TokenBatch)."""
    finetune: FineTuneData | None = None
    """Fine-tuning records, tokenized (their manifest: counts, truncation, labels, packing)."""
    uniform_loss: float | None = None
    """The loss of a uniform guess over the outputs (ln of the vocabulary or of the classes), which
    an untrained output layer should be near; None for a pretrained model, which should beat it."""

    _shared: dict = field(default_factory=dict, repr=False)

    @property
    def micro_batch_size(self) -> int:
        return self.cfg.train.nominal_micro_batch

    def shared(self, make: Callable[[Subject], T]) -> T:
        """``make(subject)``, computed once and shared by every check that asks for it."""
        if make not in self._shared:
            self._shared[make] = make(self)
        return self._shared[make]


# -- the subject --------------------------------------------------------------------------------


def _device(cfg: Config) -> tuple[torch.device, str | None]:
    """The configured device, or the CPU and the reason the configured one cannot be used."""
    try:
        return resolve_device(cfg.run.device), None
    except (ConfigError, RuntimeError) as e:
        return torch.device("cpu"), str(e)


def _finetune_job(job: FineTuneJob, device: torch.device, device_problem: str | None) -> Subject:
    """A fine-tuning job: its records, tokenized by the model's own tokenizer."""
    cfg, family = job.cfg, job.family
    try:
        job.prepare(World(device=device), console=False)
        problem = None
    except DataError as e:  # the model is fine (it was resolved), the records are not
        problem = str(e)
    args, tokenizer = job.args, job.tokenizer
    sft = type(job) is FineTuneJob  # not a preference or GRPO job, which are fine-tuning jobs too
    # Records checks and the uniform-guess loss are supervised fine-tuning's; a preference or
    # GRPO objective's own data and loss run through the same probes.
    data = None if problem or not sft else job.data
    vocab = args.config["vocab_size"]
    if cfg.model.task == "sequence_classification":
        uniform = math.log(len(args.labels)) if args.labels else None
    else:
        uniform = math.log(vocab) if cfg.model.weights == "random" and sft else None
    with torch.device("meta"):
        num_params = sum(p.numel() for p in family.build(args).parameters())
    m = None if problem else job.manifest
    source = (
        f"data.source={cfg.data.source!r}: {m['records']['train']:,} train / {m['records']['val']:,} val "
        f"{cfg.model.task if sft else cfg.run.job} records ({m['split']})"
        if m
        else f"data.source={cfg.data.source!r}"
    )
    return Subject(
        cfg=cfg,
        device=device,
        device_problem=device_problem,
        new_model=None if problem else lambda: job.whole_model(device),
        loss_fn=job.loss_fn if not problem else family.loss,
        train_data=None if problem else job.train_data,
        val_data=data.val if data else None,
        tokenizer=tokenizer,
        eot=None,
        vocab_size=vocab,
        num_params=num_params,
        head_dim=family.head_dim(args),
        data_problem=problem,
        source=source,
        collate_fn=job.collate_fn if not problem else default_collate,
        finetune=data,
        uniform_loss=uniform,
    )


def build_job(
    cfg: Config,
    model: nn.Module | None,
    loss_fn: LossFn | None,
    train_data: Dataset | None,
    val_data: Dataset | None,
    tokenizer: Any,
    vocab_size: int | None,
    progress: bool,
) -> Subject:
    """The job of ``cfg``, with any of its pieces replaced by the user's (see ``run_doctor``)."""
    device, device_problem = _device(cfg)
    # Its precision is what "auto" is on the device the doctor can use.
    job = job_for(resolve_precision(cfg, device))
    cfg = job.cfg
    if model is None and train_data is None and isinstance(job, FineTuneJob):
        return _finetune_job(job, device, device_problem)
    prepared, data_problem = None, None
    if train_data is None:
        try:  # the corpus the job trains on (a mixture's first source)
            prepared = next(iter(job.prepare_data(World(device=device), console=progress).values()), None)
        except DataError as e:
            data_problem = str(e)
        if prepared is not None:
            seq_len = cfg.data.seq_len
            train_data = TokenSequences(prepared.tokens("train"), seq_len)
            val_data = val_data if val_data is not None else TokenSequences(prepared.tokens("val"), seq_len)
            tokenizer = prepared.tokenizer if tokenizer is None else tokenizer
    eot = _eot_of(tokenizer, prepared)
    family = job.family
    if model is None:
        if prepared is not None:
            vocab = prepared.vocab_size
        else:
            vocab = vocab_size or (tokenizer.get_vocab_size() if tokenizer is not None else cfg.data.vocab_size)
        args = family.resolve(cfg.model, vocab_size=vocab, seq_len=cfg.data.seq_len)
        new_model = None if data_problem else _seeded(family, args, cfg.train.seed, device)
        with torch.device("meta"):
            num_params = sum(p.numel() for p in family.build(args).parameters())
        vocab_size, head_dim = vocab, family.head_dim(args)
        uniform: float | None = math.log(vocab)
    else:
        pristine = copy.deepcopy(model)

        def new_model() -> nn.Module:
            return copy.deepcopy(pristine).to(device)

        vocab_size = vocab_size or _model_vocab_size(model)
        num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        head_dim = None
        uniform = math.log(vocab_size) if vocab_size else None
    return Subject(
        cfg=cfg,
        device=device,
        device_problem=device_problem,
        new_model=new_model,
        loss_fn=loss_fn or family.loss,
        train_data=train_data,
        val_data=val_data,
        tokenizer=tokenizer,
        eot=eot,
        vocab_size=vocab_size,
        num_params=num_params,
        uniform_loss=uniform,
        head_dim=head_dim,
        prepared=prepared,
        data_problem=data_problem,
        source=_describe_source(cfg, prepared, train_data, val_data),
    )


def _seeded(family, args, seed: int, device: torch.device) -> Callable[[], nn.Module]:
    def new_model() -> nn.Module:
        # As the LM job builds it: the same seed gives the same weights.
        return build_model(family, args, "cpu", seed).to(device)

    return new_model


def _eot_of(tokenizer, prepared: PreparedData | None) -> int | None:
    if prepared is not None:
        return prepared.eot_id
    if tokenizer is None:
        return None
    try:
        return eot_id(tokenizer)
    except DataError:
        return None


def _model_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary a model predicts over: ``config.vocab_size`` (kiln's GPT, Hugging Face
    models), else the rows of its largest ``nn.Embedding`` (position tables are smaller), else
    None."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(rows) if rows else None


def _describe_source(cfg: Config, prepared, train_data, val_data) -> str:
    if prepared is not None:
        splits = prepared.manifest["splits"]
        return (
            f"data.source={cfg.data.source!r} prepared in {prepared.dir} "
            f"({'tokenized now' if prepared.tokenized else 'cached'}): "
            f"{splits['train']['documents']:,} train / {splits['val']['documents']:,} val documents, "
            f"{splits['train']['tokens']:,} / {splits['val']['tokens']:,} tokens, vocab {prepared.vocab_size:,}"
        )
    if train_data is None:
        return f"data.source={cfg.data.source!r}"
    val = f"{type(val_data).__name__} of {len(val_data):,} items" if val_data is not None else "none"
    return f"train_data: {type(train_data).__name__} of {len(train_data):,} items; val_data: {val}"
