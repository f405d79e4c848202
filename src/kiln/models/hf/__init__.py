"""Hugging Face models as a family: any local ``transformers`` causal LM (``AutoModelForCausalLM``)
or BERT-style classifier (``AutoModelForSequenceClassification``), named by
``model.source = "hf:PATH"`` and ``model.task``.

kiln trains ``transformers``' own classes, inside a thin module that gives them kiln's calling
convention (``model(input_ids, labels=..., attention_mask=..., position_ids=...)`` is the mean
loss). A causal LM's loss goes through kiln's fused output layer + cross-entropy, from the
decoder's hidden states, so no [tokens, vocab] logits are made. The repeated layers (one FSDP and
activation-checkpointing unit each) are found by their class; Llama-class models (Llama, Mistral,
Qwen2/3) also split over tensor-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ConfigError, ModelConfig
from kiln.labels import IGNORE_INDEX
from kiln.models.family import (
    TRANSFORMERS_ATTENTION,
    TRANSFORMERS_EXPERTS,
    MemoryModel,
    ModelFamily,
    ParallelPlan,
    StateDictAdapter,
    build_model,
)
from kiln.models.fused_loss import LinearCrossEntropy
from kiln.models.gpt.memory import GPTMemory
from kiln.models.gpt.model import GPTConfig
from kiln.models.hf.decode import HFDecoding
from kiln.models.hf.loading import (
    Pretrained,
    has_weights,
    load_tokenizer,
    model_dir,
    read_config,
    transformers_module,
    weights_error,
)
from kiln.models.hf.memory import EncoderMemory, ffn_width
from kiln.models.hf.moe import routed_weights, split_experts, watch_routers
from kiln.models.hf.parallelize import QK_NORM_HEADS, llama_root_styles, llama_styles
from kiln.models.init import params_on_meta
from kiln.models.lm import packed

TASKS = {"causal_lm": "AutoModelForCausalLM", "sequence_classification": "AutoModelForSequenceClassification"}
MAPPINGS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
}
# Architectures whose decoder layers split Megatron-style under the same projection names.
LLAMA_CLASS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
# Architectures under which records packed into one row attend to each other (checked on
# transformers 5: 16 others, Llama, Qwen, Gemma, Phi, GPT-2 and GPT-NeoX among them, keep them apart).
MIXES_PACKED_RECORDS = ("opt", "bloom", "mamba", "mamba2", "falcon_mamba")
# Config attributes that change logits after the output projection: such models keep their own head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass(frozen=True)
class HFArgs:
    path: str
    task: str
    config: Mapping[str, Any]
    weights: str = "pretrained"
    labels: tuple[str, ...] = field(default_factory=tuple)  # sequence_classification: id -> name
    allow_missing: bool = False  # model.allow_missing

    def hf_config(self):
        """The ``transformers`` config object, with the label names of a classifier."""
        transformers = transformers_module()
        config = transformers.CONFIG_MAPPING[self.config["model_type"]].from_dict(dict(self.config))
        if self.task == "sequence_classification" and self.labels:
            config.num_labels = len(self.labels)
            config.id2label = dict(enumerate(self.labels))
            config.label2id = {name: i for i, name in enumerate(self.labels)}
            config.problem_type = "single_label_classification"
        return config


class _Transformers(Protocol):
    """What kiln calls on a ``transformers`` model (PEFT's wrapper of one forwards these to it)."""

    @property
    def base_model(self) -> nn.Module: ...

    def get_input_embeddings(self) -> nn.Module | None: ...

    def get_output_embeddings(self) -> nn.Module | None: ...

    def init_weights(self) -> None: ...


class _PeftWrapper(Protocol):
    """PEFT's wrapper of a ``transformers`` model."""

    def get_base_model(self) -> nn.Module: ...


def _base(hf: nn.Module) -> nn.Module:
    """The ``transformers`` model itself, under a PEFT (LoRA) wrapper if there is one."""
    return cast(_PeftWrapper, hf).get_base_model() if hasattr(hf, "get_base_model") else hf


def _root_styles(model: nn.Module) -> dict[str, Any]:
    """``llama_root_styles`` of kiln's wrapper ``model`` of a causal LM, at the paths its decoder
    and output layer have there (PEFT's wrapper moves them)."""
    names = {id(module): name for name, module in model.named_modules()}
    hf = cast(_Transformers, _base(cast(CausalLM, model).hf))
    return llama_root_styles(names[id(hf.base_model)], names[id(hf)] + ".lm_head")


class CausalLM(nn.Module):
    """A ``transformers`` causal LM with kiln's convention: given labels (aligned with the inputs,
    -100 where no loss is wanted; shifted here), the mean loss of the counted tokens."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        config = hf.config
        head = cast(_Transformers, hf).get_output_embeddings()
        self.fused = (
            isinstance(head, nn.Linear)
            and head.bias is None
            and not any(getattr(config, a, None) for a in LOGIT_TRANSFORMS)
            # The decoder under the head is found (Llama 4's base_model_prefix names none: itself).
            and cast(_Transformers, hf).base_model is not hf
        )
        # The fused loss, a module a layout can replace (loss parallelism).
        self.loss = LinearCrossEntropy() if self.fused else None

    def init_weights(self) -> None:
        cast(_Transformers, self.hf).init_weights()

    def forward(
        self,
        input_ids,
        labels=None,
        attention_mask=None,
        position_ids=None,
        token_type_ids=None,
        targets=None,
        token_logps=False,
        positions=None,
        decoding=None,
    ):
        """Logits; or given ``labels`` (aligned with the inputs, shifted here) or ``targets`` (the
        next token of each input, as kiln's GPT takes them on text), the mean loss; with
        ``token_logps``, each target's log-probability instead [B, T'] (0 where -100), in fp32.
        ``positions``: packed documents' positions (kiln's name for ``position_ids``). A pipeline
        stage without the embedding takes hidden states for ``input_ids``, and one without the
        output layer returns hidden states. ``decoding``: the decoder's keywords for
        ``transformers`` (its cache, which positions' logits to keep; kiln.models.hf.decode),
        passed through here so that what a layout hooks on this module runs (FSDP gathering the
        embedding and output layer)."""
        hf = cast(_Transformers, _base(self.hf))
        position_ids = position_ids if position_ids is not None else positions
        embedded = "input_ids" if hf.get_input_embeddings() is not None else "inputs_embeds"
        inputs = {embedded: input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        head = hf.get_output_embeddings()
        if decoding is not None and head is None:  # a pipeline stage before the last: no logits to keep
            cache = {key: value for key, value in decoding.items() if key != "logits_to_keep"}
            return hf.base_model(**inputs, use_cache=True, **cache).last_hidden_state
        if decoding is not None:
            return cast(nn.Module, hf)(**inputs, use_cache=True, **decoding).logits
        if head is None:
            return hf.base_model(**inputs, use_cache=False).last_hidden_state
        if labels is None and targets is None:
            return self.hf(**inputs, use_cache=False).logits
        # Labels' targets are the next tokens, the last position's none (-100): every position
        # is scored, so the hidden states are never cut (sequence parallelism splits positions).
        given = targets if targets is not None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        cut = slice(None) if targets is not None else slice(None, -1)
        if not self.fused:
            logits = self.hf(**inputs, use_cache=False).logits.flatten(0, 1).float()
            if token_logps:
                nll = F.cross_entropy(logits, given.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
                return -nll.view(given.shape)[:, cut]
            return F.cross_entropy(logits, given.flatten())
        hidden = hf.base_model(**inputs, use_cache=False).last_hidden_state
        weight = cast(nn.Linear, head).weight  # fused: a Linear head (checked in __init__)
        loss = cast(LinearCrossEntropy, self.loss)
        return loss.log_probs(hidden, weight, given)[:, cut] if token_logps else loss(hidden, weight, given)


class SequenceClassifier(nn.Module):
    """A ``transformers`` sequence classifier with kiln's convention: given labels [B], the mean loss."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def init_weights(self) -> None:
        cast(_Transformers, self.hf).init_weights()

    def forward(self, input_ids, labels=None, attention_mask=None, position_ids=None, token_type_ids=None):
        logits = self.hf(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
        return logits if labels is None else F.cross_entropy(logits.float(), labels)


WRAPPERS = {"causal_lm": CausalLM, "sequence_classification": SequenceClassifier}


class HFNames(StateDictAdapter):
    """kiln's names are the ``transformers`` model's under ``hf.`` (and PEFT's, with LoRA)."""

    def __init__(self, args: HFArgs):
        self.args = args

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name.removeprefix("hf."): t for name, t in state.items()}

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"hf.{name}": t for name, t in state.items()}

    def hf_config(self) -> dict[str, Any]:
        return self.args.hf_config().to_dict()


def _layer_type(model: nn.Module) -> type | None:
    """The class of the repeated layers: the children of the largest ModuleList of one class."""
    best, size = None, -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                best, size = type(module[0]), n
    return best


def _heads(config: Any) -> int:
    """A config's attention heads, read through its attribute_map (GPT-2's ``n_head``, DistilBERT's
    ``n_heads``); 0 for a model without attention (Mamba, FNet)."""
    return getattr(config, "num_attention_heads", None) or 0


def _head_dim(config: Any) -> int | None:
    """A config's attention head width (DistilBERT's ``dim`` is read as ``hidden_size``); None without attention."""
    heads = _heads(config)
    return (getattr(config, "head_dim", None) or config.hidden_size // heads) if heads else None


def _model_class(args: HFArgs) -> type | None:
    """The ``transformers`` class ``model.task`` makes of the directory's architecture (None: it has none)."""
    transformers = transformers_module()
    mapping = getattr(transformers, MAPPINGS[args.task])
    return mapping.get(transformers.CONFIG_MAPPING[args.config["model_type"]], None)


def attention(args: HFArgs) -> str:
    """The attention ``transformers`` is asked for: "sdpa" (PyTorch's fused kernels), or "eager"
    (its own matmul-softmax-matmul) for an architecture it has no SDPA for (DeBERTa-v2, ...),
    which it would refuse to build with "sdpa". ``describe`` says so."""
    model_class = _model_class(args)
    return "eager" if model_class is not None and not getattr(model_class, "_supports_sdpa", True) else "sdpa"


def _pad_id(path: Path) -> int | None:
    """The token a classifier's rows are padded with, as kiln pads them (the tokenizer's padding
    token, else its end of sequence). A decoder classifier (Llama, Qwen, GPT-2, ...) reads it from
    its config to find each row's last token, and cannot take a batch without it; many causal
    LMs' config.json have none."""
    try:
        tokenizer = load_tokenizer(path)
    except ConfigError:  # the job says what is wrong with the tokenizer
        return None
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _context(args: HFArgs) -> int | None:
    """The longest sequence the model takes: max_position_embeddings (GPT-2's n_positions), less
    the positions a RoBERTa-style embedding skips (its positions start after the padding id)."""
    config = args.hf_config()
    limit = getattr(config, "max_position_embeddings", None)
    model_class = _model_class(args)
    if not limit or model_class is None:
        return limit
    module = vars(sys.modules[model_class.__module__])
    if any(
        isinstance(obj, type)
        and obj.__module__ == model_class.__module__
        and hasattr(obj, "create_position_ids_from_input_ids")
        for obj in module.values()
    ):
        limit -= (getattr(config, "pad_token_id", None) or 0) + 1
    return limit


class HFFamily(ModelFamily):
    name = "hf"

    def resolve(self, model_cfg: ModelConfig, *, vocab_size: int, seq_len: int) -> HFArgs:
        if not model_cfg.source:
            raise ConfigError(["model.source: the hf family needs model.source = hf:PATH (a local model directory)"])
        path = model_dir(model_cfg.source)
        config = read_config(path)
        if model_cfg.weights == "pretrained" and not has_weights(path):
            raise weights_error(path)
        args = HFArgs(str(path), model_cfg.task, config, model_cfg.weights, allow_missing=model_cfg.allow_missing)
        if model_cfg.task == "sequence_classification" and getattr(args.hf_config(), "pad_token_id", None) is None:
            args = dataclasses.replace(args, config={**config, "pad_token_id": _pad_id(path)})
        limit = _context(args)
        if limit and seq_len > limit:
            raise ConfigError(
                [
                    f"data.seq_len: {seq_len} is longer than the model's context "
                    f"({limit} positions, from max_position_embeddings in {path / 'config.json'})"
                ]
            )
        return args

    def build(self, args: HFArgs) -> nn.Module:
        transformers = transformers_module()
        auto = getattr(transformers, TASKS[args.task])
        try:
            hf = auto.from_config(args.hf_config(), attn_implementation=attention(args), dtype=torch.float32)
        except ValueError as e:
            raise ConfigError([f"model.task: {args.task} does not fit {args.path}: {str(e).splitlines()[0]}"]) from None
        return WRAPPERS[args.task](watch_routers(hf))

    def create(self, args: HFArgs, device: torch.device | str, seed: int) -> nn.Module:
        """The model whole on ``device``: pretrained weights read from the directory as each rank
        reads its shards (``initial_values``), or random ones."""
        if args.weights == "random":
            return build_model(self, args, device, seed)
        with params_on_meta():
            model = self.build(args)
        cast(Pretrained, self.initial_values(args, model, seed)).materialize(model, device)
        return model.train()

    def initial_values(self, args: HFArgs, model: nn.Module, seed: int) -> Pretrained | None:
        """Pretrained weights read tensor by tensor from the directory's safetensors, each rank
        keeping only its slices, every tensor named as ``transformers`` names it (see
        ``Pretrained``): a classifier's new head from ``seed``, as ``transformers`` initialises
        it, anything else missing an error unless ``model.allow_missing``. None for random weights."""
        if args.weights != "pretrained":
            return None
        hf = _base(self.transformers_model(model))
        classifier = args.task == "sequence_classification"
        return Pretrained(model, Path(args.path), seed, hf, classifier=classifier, allow_missing=args.allow_missing)

    def keeps_packed_records_apart(self, args: HFArgs) -> bool:
        """``transformers`` turns restarting position ids into a block-diagonal mask for models
        that take position ids; OPT (positions from the attention mask), Bloom (ALiBi) and the
        state-space models do not."""
        return args.config["model_type"] not in MIXES_PACKED_RECORDS

    def tokenizer(self, args: HFArgs):
        """The directory's tokenizer, refused if it has ids past the model's embedding (a token
        that would index past it mid-run: e.g. the end-of-text token transformers' Qwen2 tokenizer
        adds to a tokenizer that has none)."""
        tokenizer = load_tokenizer(Path(args.path))
        rows = getattr(args.hf_config(), "vocab_size", None)
        vocab = tokenizer.get_vocab()
        if rows and max(vocab.values(), default=-1) >= rows:
            past = sorted((i, token) for token, i in vocab.items() if i >= rows)
            roles: dict[int | None, list[str]] = {}
            for role in ("bos", "eos", "pad", "unk"):
                roles.setdefault(getattr(tokenizer, f"{role}_token_id", None), []).append(role)
            named = ", ".join(f"{t!r} = {i}" + (f" ({'/'.join(roles[i])})" if i in roles else "") for i, t in past[:3])
            raise ConfigError(
                [
                    f"model.source: {args.path}: its tokenizer ({type(tokenizer).__name__}) has {len(past)} token(s) "
                    f"past the model's {rows} embedding rows (vocab_size in config.json): {named}; the tokenizer "
                    "does not fit this model"
                ]
            )
        return tokenizer

    def args_to_dict(self, args: HFArgs) -> dict[str, Any]:
        return {**dataclasses.asdict(args), "config": dict(args.config), "labels": list(args.labels)}

    def args_from_dict(self, values: Mapping[str, Any]) -> HFArgs:
        return HFArgs(**{**values, "labels": tuple(values.get("labels", ()))})

    def describe(self, model_cfg: ModelConfig, args: HFArgs, model: nn.Module) -> str:
        n = sum(p.numel() for p in model.parameters())
        kind = (args.config.get("architectures") or [args.config["model_type"]])[0]
        start = "pretrained" if args.weights == "pretrained" else "random weights"
        labels = f", {len(args.labels)} labels" if args.labels else ""
        eager = ""
        if attention(args) == "eager" and _heads(args.hf_config()):
            eager = f"; eager attention (transformers has no SDPA for {cast(type, _model_class(args)).__name__})"
        return f"{kind} from {args.path} ({start}), {args.task}: {n:,} parameters{labels}{eager}"

    def parallel_plan(self, args: HFArgs) -> ParallelPlan:
        with torch.device("meta"):
            model = self.build(args)
        layer = _layer_type(model)
        experts, n_experts = split_experts(self.transformers_model(model), layer)
        split: dict[str, Any] = dict(experts=experts, n_experts=n_experts, experts_call=TRANSFORMERS_EXPERTS)
        if args.config["model_type"] not in LLAMA_CLASS:
            return ParallelPlan(blocks=None, block_type=layer, **split)
        c = args.hf_config()
        divisors = {
            f"{k} (config.json)": getattr(c, k)
            for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
            if getattr(c, k, None) is not None
        }
        stages: dict[str, Any] = {}
        styles = functools.partial(llama_styles, qk_norm_heads=QK_NORM_HEADS.get(args.config["model_type"]))
        if args.task == "causal_lm":
            # Sequence, vocabulary and loss parallelism (kiln.models.hf.parallelize); the loss
            # where the wrapper's fused one computes it (no logit transform).
            fused = not any(getattr(c, name, None) for name in LOGIT_TRANSFORMS)
            split |= dict(tp_root=_root_styles, loss="loss" if fused else "", sequence_parallel=True)
            styles = functools.partial(styles, sequence_parallel=True)
            # transformers' decoders read each layer's kind by its index in the whole model.
            kinds = sorted(set(getattr(c, "layer_types", None) or ()))
            mixed = f"{args.path}: its layers mix attention kinds ({', '.join(kinds)}; layer_types in config.json), "
            stages = dict(
                pipeline_first=("model.embed_tokens",),
                pipeline_last=("model.norm", "lm_head"),
                pipeline_identity=("model.norm",),
                unpipelined=mixed + "which transformers reads by each layer's number in the whole model; set "
                "parallel.pp=1"
                if len(kinds) > 1
                else "",
            )
        return ParallelPlan(
            blocks=None,
            block_type=layer,
            tensor_parallel=styles,
            tp_divisors=divisors,
            attention=TRANSFORMERS_ATTENTION,
            **stages,
            **split,
        )

    def flops_per_token(self, args: HFArgs, seq_len: int) -> float:
        """6 x the parameters of every matmul a token goes through (each nn.Linear; a tied output
        layer once; of a mixture of experts, the router and the experts the token is routed to),
        plus attention's 12 x layers x width x context (the PaLM convention)."""
        with torch.device("meta"):
            model = self.build(args)
        seen, matmul = set(), 0
        for module in model.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                matmul += module.weight.numel()
        matmul += routed_weights(self.transformers_model(model))
        c = args.hf_config()
        width = _heads(c) * (_head_dim(c) or 0)
        return 6.0 * matmul + 12.0 * c.num_hidden_layers * width * seq_len

    def memory_model(self, args: HFArgs) -> MemoryModel:
        """Causal LMs: kiln's GPT block count on the same dimensions (a Llama-class decoder layer
        keeps what kiln's block keeps) and kiln's fused head; encoders: see EncoderMemory."""
        c = args.hf_config()
        if args.task == "sequence_classification":
            return EncoderMemory(c, num_labels=max(1, len(args.labels)))
        heads = _heads(c) or 1  # a model without attention: counted as one head
        return GPTMemory(
            GPTConfig(
                vocab_size=c.vocab_size,
                n_layer=c.num_hidden_layers,
                d_model=c.hidden_size,
                n_head=heads,
                n_kv_head=getattr(c, "num_key_value_heads", None) or heads,
                d_ff=ffn_width(c),
                max_seq_len=getattr(c, "max_position_embeddings", None) or 0,
                tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
            )
        )

    def head_dim(self, args: HFArgs) -> int | None:
        return _head_dim(args.hf_config())

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The mean loss of a ``kiln.data.batch.TokenBatch`` (padded or packed rows), or of text's
        ``(inputs, targets)`` sequences or ``TextBatch`` (continued pretraining; its documents
        marked by position_ids that restart, which ``transformers`` turns into a mask that keeps
        each to itself)."""
        if isinstance(batch, (tuple, list)):
            inputs, targets = batch
            return model(inputs, targets=targets)
        if packed(batch):
            return model(batch.inputs, targets=batch.targets, position_ids=batch.positions)
        return model(
            batch.input_ids,
            labels=batch.labels,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            token_type_ids=batch.token_type_ids,
        )

    def state_dict_adapter(self, args: HFArgs) -> HFNames:
        return HFNames(args)

    def transformers_model(self, model: nn.Module) -> nn.Module:
        return cast(nn.Module, model.hf)  # the submodule of this family's CausalLM or SequenceClassifier

    def context_length(self, args: HFArgs) -> int | None:
        return _context(args)

    def lora_targets(self, args: HFArgs) -> list[str]:
        """The modules LoRA adapts unless ``lora.target_modules`` names them: every linear layer
        of the repeated layers (PEFT's all-linear, as QLoRA and Axolotl do), named by its path in
        the layer (Llama's self_attn.q_proj, ..., mlp.down_proj; DistilBERT's attention.q_lin,
        ..., ffn.lin2), so that no head or output layer outside them matches."""
        return self._block_linears(args)

    def _block_linears(self, args: HFArgs) -> list[str]:
        """The linear layers (``transformers``' Conv1D too) of one repeated layer, by their path in it."""
        conv1d = transformers_module().pytorch_utils.Conv1D
        with torch.device("meta"):
            model = self.build(args)
        layer_type = _layer_type(model)
        layer = next((m for m in model.modules() if type(m) is layer_type), None)
        if layer is None:
            return []
        return [name for name, m in layer.named_modules() if isinstance(m, (nn.Linear, conv1d))]

    def decoding(self, model: nn.Module) -> HFDecoding | None:
        """A causal LM through ``transformers``' own forward, over kiln's slot cache; ``model`` may
        also be a module that runs a causal LM's forward over several ranks and holds this rank's
        ``part`` of it (pipeline stages' evaluation), which decoding then calls."""
        causal = getattr(model, "part", model)
        return HFDecoding(model, _base(causal.hf)) if isinstance(causal, CausalLM) else None


FAMILY = HFFamily()

__all__ = ["FAMILY", "CausalLM", "HFArgs", "HFFamily", "SequenceClassifier"]
