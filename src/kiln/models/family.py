"""Model families: the one interface through which kiln builds, splits, counts and names a kind
of model.

A family turns the user's ``[model]`` section into validated model arguments and a plain
``nn.Module``, and describes that module to the generic code from the outside: which layers
repeat (FSDP units, activation checkpointing), how its projections split over tensor-parallel
ranks, its training FLOPs per token, the memory ``kiln plan`` should expect, the names its
weights have in the Hugging Face format, and the loss, evaluation and sampling of its job.
``kiln.distributed``, ``kiln.plan``, the LM job and the doctor ask the family; none of them
names a model's modules.

kiln's GPT is the family ``gpt`` (``kiln.models.gpt``). Any other is a plug-in: an object with
the methods of ``ModelFamily`` (subclass it), named in the config as
``model.family = "package.module:object"``. ``kiln.Trainer`` trains any ``nn.Module`` without a
family; families are for the built-in jobs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import nn

from kiln.config import Config, ConfigError, ModelConfig
from kiln.models.decode import Decodable, generate
from kiln.models.init import Initial, Values, keyed
from kiln.models.lm import evaluate_lm, lm_loss

TRANSFORMERS_ATTENTION = "transformers"
TRANSFORMERS_EXPERTS = "transformers"


@dataclass(frozen=True)
class ParallelPlan:
    """How parallelism and activation checkpointing apply to a model, as data: the model stays
    plain and free of distributed imports, and ``kiln.distributed`` does the applying.

    ``blocks``: the attribute holding the repeated layers (an ``nn.ModuleList``): each is an FSDP
    unit and an activation-checkpointing unit; None if the model has none (FSDP then shards it
    as one unit). ``block_type`` instead names the layers by their class, which survives
    wrappers that move them (PEFT's LoRA, say). ``tensor_parallel``: how a repeated layer splits
    over tensor-parallel ranks, as PyTorch's ``ParallelStyle`` objects by module path in the layer
    (a function of the layer, which builds them when asked: the family's ``parallelize.py``,
    never the model's code, imports what is distributed); ``tp_root``: those of the modules outside the
    layers (the embedding, the final norm, the output layer), by the end of their path in the
    model (a function of the model, or of the pipeline stage it is cut to); ``loss``: the
    model's loss module (``kiln.models.fused_loss.LinearCrossEntropy``, called with the output
    layer's weight), which tensor parallelism computes on that weight's rows split over the
    ranks; ``sequence_parallel``: the styles split the activations between layers by position.
    ``tp_divisors``: the config keys whose values the tensor-parallel degree must divide, with
    those values.
    ``derived_buffers``: the model's buffers are computed from its config and equal on every rank,
    so DDP need not broadcast them before each forward.
    ``pipeline_first`` and ``pipeline_last``: the modules that go with the first pipeline stage
    (the embedding) and with the last (final norm, output layer), by path in the model or by the
    end of it (``model.norm``: a Hugging Face model's under kiln's wrapper, and PEFT's); a model
    that can be pipelined names them, and its ``forward`` runs with any of them set to None:
    without the first it takes hidden states instead of tokens, without the last it returns
    hidden states (given targets, the last stage returns the loss). ``pipeline_identity``: those
    of the last stage's that a stage without them holds as ``nn.Identity`` instead (the final
    norm ``transformers``' decoders always call). ``unpipelined``: why this model, though its
    family pipelines others, cannot be cut into stages (empty: it can).
    ``experts``: where a block holds a mixture of experts' experts (``mlp.experts``; see
    ``kiln.distributed.experts`` for what such a module provides), which expert parallelism
    splits; ``n_experts``: how many each holds (the expert-parallel degree must divide it);
    ``experts_call``: how they are called, kiln's ``forward(x, ends)`` (empty) or
    ``TRANSFORMERS_EXPERTS``: a ``transformers`` experts module (3-D ``gate_up_proj`` and
    ``down_proj``) called with each token's chosen experts and their weights, which computes
    through ``transformers``' experts interface.
    ``attention``: where a block holds its attention's core, a module without parameters whose
    ``forward(q, k, v, mask, causal)`` computes it (kiln's GPT: ``attn.core``), in a model whose
    ``forward(idx, targets, ..., positions=...)`` takes the tokens' positions: context
    parallelism puts its own core in that one's place and splits the model's inputs around its
    forward (``kiln.distributed.context``). Or ``TRANSFORMERS_ATTENTION``: the model is kiln's
    wrapper of a ``transformers`` causal LM (under ``hf``) whose attention function context
    parallelism plugs in through ``transformers.AttentionInterface``.
    """

    blocks: str | None = "blocks"
    block_type: type | None = None
    tensor_parallel: Callable[[nn.Module], Mapping[str, Any]] | None = None
    tp_root: Callable[[nn.Module], Mapping[str, Any]] | None = None
    loss: str = ""
    sequence_parallel: bool = False
    tp_divisors: Mapping[str, int] = field(default_factory=dict)
    derived_buffers: bool = False
    pipeline_first: tuple[str, ...] = ()
    pipeline_last: tuple[str, ...] = ()
    pipeline_identity: tuple[str, ...] = ()
    unpipelined: str = ""
    experts: str = ""
    n_experts: int = 0
    experts_call: str = ""
    attention: str = ""

    @property
    def pipelined(self) -> bool:
        """Whether the model can be cut into pipeline stages: the plan names the first and last
        stages' modules, and the repeated layers."""
        named = bool(self.pipeline_first or self.pipeline_last) and bool(self.blocks or self.block_type)
        return named and not self.unpipelined

    def pipeline_error(self, what: str) -> str:
        """Why ``what`` (the model's name) cannot be pipelined."""
        if self.unpipelined:
            return f"parallel.pp: {self.unpipelined}"
        return (
            f"parallel.pp: {what} cannot be split into pipeline stages: its family's parallel plan does not name "
            "the modules of the first and last stage (kiln's GPT and Llama-class Hugging Face causal LMs do); set "
            "parallel.pp=1"
        )

    @classmethod
    def infer(cls, model: nn.Module) -> ParallelPlan:
        """The plan of a model without a family: its ``blocks`` if it has them, no tensor parallelism."""
        return cls(blocks="blocks" if isinstance(getattr(model, "blocks", None), nn.ModuleList) else None)

    def pipeline_paths(self, model: nn.Module) -> tuple[str, dict[str, str], dict[str, str]]:
        """Where ``model`` holds them (their paths, as ``named_modules`` names them): the
        container of the repeated layers, and the first and the last stage's modules it holds
        (a stage may have none of them), each by the plan's name of it."""
        if self.blocks is not None:
            container = self.blocks
        else:
            names = {id(m): name for name, m in model.named_modules()}
            first_block = names[id(self.repeated_blocks(model)[0])]
            container = first_block.rpartition(".")[0]
        return container, self.find(model, self.pipeline_first), self.find(model, self.pipeline_last)

    @staticmethod
    def find(model: nn.Module, ends: Iterable[str]) -> dict[str, str]:
        """The path in ``model`` of each module the plan names by the end of its path (wrappers,
        PEFT's, add to the front), of those ``model`` holds."""
        names = [name for name, _ in model.named_modules()]
        out = {}
        for end in ends:
            hits = [name for name in names if name == end or name.endswith("." + end)]
            if len(hits) > 1:
                raise ValueError(f"the parallel plan's {end!r} names {len(hits)} modules of {type(model).__name__}")
            out.update({end: hits[0]} if hits else {})
        return out

    def repeated_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated layers; an empty list if the plan names none."""
        if self.block_type is not None:
            return [m for m in model.modules() if isinstance(m, self.block_type)]
        if self.blocks is None:
            return []
        blocks = model.get_submodule(self.blocks)
        # A pipeline stage holds some of them, keyed by their numbers in the whole model.
        if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"the parallel plan names {self.blocks!r} as the repeated layers of "
                f"{type(model).__name__}, but it is a {type(blocks).__name__}, not an nn.ModuleList"
            )
        return list(blocks.children())

    def block_parts(self, model: nn.Module, path: str) -> list[nn.Module]:
        """The submodule ``path`` (e.g. the plan's ``experts``) of each repeated layer that has one."""
        found = []
        for block in self.repeated_blocks(model):
            try:
                found.append(block.get_submodule(path))
            except AttributeError:
                continue
        return found

    def check_tensor_parallel(self, tp: int, what: str) -> None:
        """Raise ConfigError unless ``tp`` can split this model; ``what`` names the model."""
        if tp == 1:
            return
        if self.tensor_parallel is None:
            raise ConfigError(
                [
                    f"parallel.tp: tensor parallelism needs a model family's plan of which projections "
                    f"to split; {what} has none"
                ]
            )
        bad = [f"{key}={value}" for key, value in self.tp_divisors.items() if value % tp]
        if bad:
            raise ConfigError([f"parallel.tp: {tp} must divide {', '.join(bad)}"])


@dataclass(frozen=True)
class MemoryContext:
    """What a family's memory model needs to know of a setup: ``tokens`` of one micro-batch on
    one device, ``seq_len`` tokens per sequence; ``autocast``: matmuls run in 16 bits and return 16-bit activations;
    ``residual_bytes``: bytes per element of the residual stream between blocks (4, or 2 when FSDP
    computes with gathered bf16 weights); ``tp``: the tensor-parallel degree; ``casts_weights``:
    autocast makes 16-bit copies of the fp32 weights (and keeps them for the backward pass);
    ``cp``: the context-parallel degree (``tokens`` are then this rank's 1 / cp of the sequences,
    whose attention sees the keys of all of them); ``device``: the kind of device ("cpu",
    "cuda"), where kernels' working sizes depend on it; ``compiled``: the forward and backward are
    torch.compile's graph from the first step, which keeps fewer activations (it recomputes
    cheap pointwise results in the backward); ``sequence_parallel``: the plan's tensor
    parallelism splits the activations between the blocks' projections by position, and the
    output layer and loss by vocabulary (loss parallelism)."""

    tokens: int
    autocast: bool
    residual_bytes: int
    tp: int
    casts_weights: bool
    seq_len: int = 0
    cp: int = 1
    device: str = "cpu"
    compiled: bool = False
    sequence_parallel: bool = False

    @property
    def act_bytes(self) -> int:
        """Bytes per element of what a matmul returns."""
        return 2 if self.autocast else 4


class HeadMemory(NamedTuple):
    """Bytes of the output layer and loss: ``saved`` from its forward for its backward, the largest
    ``transient`` beyond that during its forward, and all it holds at the peak of its backward."""

    saved: int
    transient: int
    backward: int


class MemoryModel:
    """The bytes a family's model keeps for its backward pass, for ``kiln plan``. The planner
    itself counts parameters, gradients, optimizer state, sharding, gathered weights and
    autocast copies of the blocks' matrices from the model's parameter list; a family adds what
    only it knows: activations, the loss, and the transients of its backward pass."""

    n_layer: int
    d_model: int
    vocab_size: int
    buffers: str = "model buffers"
    """What the model's buffers hold, as the plan's label says it."""
    backward_peak_grad: str | None = None
    """The block parameter (relative to the block) whose new gradient exists at the peak of a
    block's backward pass, or None."""
    kv_width: int = 0
    """Elements of a token's keys (as many of its values): what context parallelism gathers; 0
    for d_model."""
    experts_per_token: int = 1
    """Copies of a token that a mixture of experts sends to its experts (expert parallelism)."""
    counts_compiled: bool = False
    """Whether the model counts what a compiled graph keeps (``MemoryContext.compiled``); if
    not, the plan's figure for a compiled run is eager autograd's, an upper bound."""

    def block_activations(self, ctx: MemoryContext) -> int:
        """Bytes one block keeps from its forward for its backward."""
        raise NotImplementedError

    def checkpointed_block(self, ctx: MemoryContext) -> int:
        """Bytes one block keeps under activation checkpointing (its input)."""
        return ctx.tokens * self.d_model * ctx.residual_bytes

    def block_backward_workspace(self, ctx: MemoryContext) -> int:
        """Transient bytes at the peak of one block's backward pass (gradients flowing through it)."""
        raise NotImplementedError

    def before_blocks(self, ctx: MemoryContext) -> int:
        """Bytes kept from before the first repeated layer until the end of backward (an embedding
        norm's saved tensors)."""
        return 0

    def after_blocks(self, ctx: MemoryContext) -> int:
        """Bytes kept between the last block and the loss (e.g. a final norm's saved tensors)."""
        return 0

    def head(self, ctx: MemoryContext) -> HeadMemory:
        """The output layer and loss."""
        raise NotImplementedError

    def head_weight_copy(self, ctx: MemoryContext) -> int:
        """Bytes of autocast's low-precision copy of the output layer's weight, if it makes one."""
        return 0

    def embedding_backward(self, ctx: MemoryContext, accumulating: bool) -> int:
        """Transient bytes of the embedding's backward; ``accumulating``: earlier micro-batches'
        gradients are already held."""
        raise NotImplementedError


class ExportError(RuntimeError):
    """The model cannot be exported to the format asked for; the message says why. Here, below the
    exporters, so that a family's adapter can refuse a model no Hugging Face architecture computes."""


class StateDictAdapter:
    """Weight names to and from a Hugging Face model's, so kiln's checkpoints load there and back
    (ExportError, saying why, for a model that has no such equivalent)."""

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent Hugging Face model."""
        raise NotImplementedError

    def cut_config(self, layers: list[int]) -> dict[str, Any] | None:
        """The ``config.json`` of the model cut to its repeated ``layers`` (renumbered from 0), or
        None where the adapter cannot say (a check of an export then builds the model from its
        own config)."""
        return None


class ModelFamily:
    """One kind of model, as kiln's jobs and tools see it. Subclass it for a plug-in family."""

    name: str = ""

    # -- building ------------------------------------------------------------------------------

    def resolve(self, model_cfg: ModelConfig, *, vocab_size: int, seq_len: int) -> Any:
        """The model's arguments from the ``[model]`` section, the tokenizer's vocabulary and the
        context length; ConfigError listing every invalid ``model.*`` value."""
        raise NotImplementedError

    def build(self, args: Any) -> nn.Module:
        """The plain model, constructed on the current default device: ``kiln plan`` builds it on
        the ``meta`` device (shapes, no storage); ``materialize`` then allocates and initialises."""
        raise NotImplementedError

    def create(self, args: Any, device: torch.device | str, seed: int) -> nn.Module:
        """The model a run starts from: by default built on ``meta`` and initialised from ``seed``
        (``build_model``); a family of pretrained models loads their weights instead."""
        return build_model(self, args, device, seed)

    def initial_values(self, args: Any, model: nn.Module, seed: int) -> Values | None:
        """The starting value of each of ``model``'s tensors by name (``model``: built on ``meta``
        from ``args``, LoRA adapters included), so that each rank can write only the shards it
        holds; None where the family cannot say (the run then creates the whole model on every
        rank). By default: a model that initialises its tensors by name, from ``seed``."""
        return Initial(model, seed) if keyed(model) else None

    def keeps_packed_records_apart(self, args: Any) -> bool:
        """Whether records packed into one row (``data.packing``), each with positions restarting
        at 0, attend only within themselves."""
        return True

    def tokenizer(self, args: Any) -> Any:
        """The model's own tokenizer, for a family that comes with one (None: kiln's data pipeline
        trains or loads one)."""
        return None

    def args_to_dict(self, args: Any) -> dict[str, Any]:
        """The arguments as JSON (the run's ``model.json``)."""
        raise NotImplementedError

    def args_from_dict(self, values: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def describe(self, model_cfg: ModelConfig, args: Any, model: nn.Module) -> str:
        """One line about the model (of the ``[model]`` section ``model_cfg``) for the console."""
        return f"{sum(p.numel() for p in model.parameters()):,} parameters"

    # -- how it splits and what it costs ------------------------------------------------------

    def parallel_plan(self, args: Any) -> ParallelPlan:
        """How the model splits. By default: its ``blocks`` (an ``nn.ModuleList``) if it has them,
        as FSDP and activation-checkpointing units, and no tensor or pipeline parallelism."""
        with torch.device("meta"):
            return ParallelPlan.infer(self.build(args))

    def flops_per_token(self, args: Any, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token, for MFU and ``kiln plan``. By default
        the usual estimate of 6 per parameter (a weight's multiply-add forward, twice that
        backward), without attention's share, which a family with attention should add."""
        with torch.device("meta"):
            model = self.build(args)
        return 6.0 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    def memory_model(self, args: Any) -> MemoryModel:
        raise NotImplementedError

    def head_dim(self, args: Any) -> int | None:
        """The attention head width (the doctor checks the flash kernel with it), or None."""
        return None

    def state_dict_adapter(self, args: Any) -> StateDictAdapter | None:
        return None

    def lora_targets(self, args: Any) -> list[str]:
        """The module names LoRA adapts by default (``lora.target_modules`` empty)."""
        return []

    def transformers_model(self, model: nn.Module) -> nn.Module | None:
        """The ``transformers`` model that ``model`` wraps (a family of Hugging Face models: LoRA
        goes through PEFT's own wrapper, exports through ``save_pretrained``), or None."""
        return None

    def context_length(self, args: Any) -> int | None:
        """The most positions the model attends to, or None if it does not say."""
        return None

    # -- its job ---------------------------------------------------------------------------------

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of one micro-batch (the Trainer's ``loss_fn``)."""
        return lm_loss(model, batch)

    def evaluate(
        self, model: nn.Module, batches: list, token_bytes: torch.Tensor, device: torch.device
    ) -> dict[str, float]:
        """Validation metrics over fixed batches (eval mode, no_grad, the run's precision)."""
        return evaluate_lm(model, batches, token_bytes, device, self.loss)

    def decoding(self, model: nn.Module) -> Decodable | None:
        """How ``kiln.models.decode`` runs ``model`` (``kiln serve``, ``kiln generate``, samples,
        evaluation tasks that generate, GRPO): its ``forward`` over a ``SlotCache``; None if the
        family cannot sample."""
        return None

    def generate(
        self, model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **sampling: Any
    ) -> torch.Tensor | None:
        """Continue ``prompt`` [B, T]: [B, T + new] token ids (rows that ended early padded with
        the end-of-text id); None if the family cannot sample. ``sampling``: the keywords of
        ``kiln.models.decode.generate``."""
        decodable = self.decoding(model)
        if decodable is None:
            return None
        rows = generate(decodable, prompt.tolist(), max_new_tokens, **sampling)
        width = max(map(len, rows))
        pad = sampling.get("eos_id") or 0
        new = torch.tensor([row + [pad] * (width - len(row)) for row in rows], device=prompt.device)
        return torch.cat([prompt, new], dim=1)


class _Resettable(Protocol):
    def reset_parameters(self) -> None: ...


class _Initialisable(Protocol):
    def init_weights(self) -> None: ...


def materialize(model: nn.Module, device: torch.device | str, seed: int) -> nn.Module:
    """Allocate a model built on the ``meta`` device on ``device`` and initialise it from ``seed``.

    A model that initialises its tensors by name (``kiln.models.init``; kiln's GPT) draws each
    from ``seed`` and the tensor's name. Any other: PyTorch's own initialisation of every module
    (``reset_parameters``, in construction order) runs first, then the model's ``init_weights``:
    the same draws from the same generator as constructing the model eagerly after
    ``torch.manual_seed(seed)``, so either way gives bitwise the same weights."""
    if keyed(model):
        Initial(model, seed).materialize(model, device)
        return model
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if module is not model and hasattr(module, "reset_parameters"):
                cast(_Resettable, module).reset_parameters()
        if hasattr(model, "init_weights"):
            cast(_Initialisable, model).init_weights()
    return model


def build_model(family: ModelFamily, args: Any, device: torch.device | str, seed: int) -> nn.Module:
    """The family's model for ``args``, built on ``meta`` and materialised on ``device`` from ``seed``."""
    with torch.device("meta"):
        model = family.build(args)
    return materialize(model, device, seed)


BUILT_IN = {"gpt": "kiln.models.gpt:FAMILY", "hf": "kiln.models.hf:FAMILY"}


def get_family(name: str) -> ModelFamily:
    """The family ``model.family`` names: a built-in one, or ``package.module:object``."""
    target = BUILT_IN.get(name, name)
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ConfigError(
            [
                f"model.family: {name!r} is not one of {', '.join(BUILT_IN)}, nor a plug-in given as "
                "package.module:object"
            ]
        )
    try:
        family = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError([f"model.family: cannot load {name!r}: {e}"]) from None
    if isinstance(family, type) and issubclass(family, ModelFamily):
        family = family()
    if not isinstance(family, ModelFamily):
        raise ConfigError([f"model.family: {name!r} is a {type(family).__name__}, not a kiln.models.ModelFamily"])
    return family


def family_of(model_cfg: ModelConfig) -> ModelFamily:
    """The family of a ``[model]`` section: hf for a ``model.source`` of hf:PATH, else ``model.family``."""
    if model_cfg.source:
        if model_cfg.family not in ("gpt", "hf"):
            raise ConfigError(
                [
                    f"model.family: {model_cfg.family!r} cannot load model.source={model_cfg.source!r}; "
                    "a Hugging Face model directory is the hf family (leave model.family unset)"
                ]
            )
        return get_family("hf")
    return get_family(model_cfg.family)


def check_model_config(cfg: Config) -> None:
    """Check ``[model]`` with its family before anything runs (ConfigError naming the keys); the
    vocabulary is ``data.vocab_size`` here, the tokenizer's once the data is prepared."""
    family_of(cfg.model).resolve(cfg.model, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
