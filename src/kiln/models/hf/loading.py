"""A local Hugging Face model directory, read safely: its config, weights and tokenizer.

Nothing is downloaded (``local_files_only``, and the hub is told it is offline) and no code from
the directory runs (``trust_remote_code`` stays off: a model whose config maps to its own Python
classes is refused). Weights are read from safetensors only, one file or a sharded index.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from kiln.compat import quiet_library_imports
from kiln.config import ConfigError
from kiln.io import weight_files
from kiln.models.init import Values, lora_kind, plain_name, tensor_seed

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _offline() -> None:
    # Belt and braces beside local_files_only: nothing the hub library does may reach the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def transformers_module():
    """``transformers``, or a config error saying how to get it."""
    quiet_library_imports()  # transformers imports torchao (where installed) when it loads a model
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            ["model.source: Hugging Face models need the transformers package: pip install 'kiln[hf]'"]
        ) from None
    _offline()
    # kiln reports what it loads itself; transformers' progress bars and load reports would
    # interleave with every rank's output.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def model_dir(source: str) -> Path:
    """The directory of ``model.source = "hf:PATH"``, checked: config.json and safetensors weights."""
    path = Path(source.removeprefix("hf:")).expanduser()
    if not path.is_dir():
        raise ConfigError([f"model.source: {path} is not a directory (a local Hugging Face model directory)"])
    if not (path / "config.json").is_file():
        raise ConfigError([f"model.source: {path} has no config.json; it is not a Hugging Face model directory"])
    return path.absolute()


def has_weights(path: Path) -> bool:
    return any((path / name).is_file() for name in WEIGHT_FILES)


def weights_error(path: Path) -> ConfigError:
    other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = (
        (
            f"; it has {', '.join(other)}, which kiln does not load (pickle files can run code): convert them to "
            "safetensors"
        )
        if other
        else ""
    )
    return ConfigError(
        [
            f"model.source: {path} has no {' or '.join(WEIGHT_FILES)}{hint}; or set "
            "model.weights=random to train the architecture from scratch"
        ]
    )


def read_config(path: Path, key: str = "model.source") -> dict[str, Any]:
    """config.json as a dict, refused (naming ``key``, the setting that named ``path``) if it needs
    code from the directory or an unknown architecture."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"{key}: {path / 'config.json'} is not readable JSON: {e}"]) from None
    if config.get("auto_map"):
        raise ConfigError(
            [
                f"{key}: {path} needs its own Python code (config.json has auto_map, i.e. "
                "trust_remote_code); kiln never runs code from a model directory"
            ]
        )
    if quantized := config.get("quantization_config"):
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ConfigError(
            [
                f"{key}: {path / 'config.json'} describes quantized weights (quantization_config: {method}); "
                "kiln fine-tunes from unquantized ones (fp32, bf16, fp16): use the model's unquantized "
                "directory, with lora.quantize_base=nf4 for a 4-bit base"
            ]
        )
    model_type = config.get("model_type")
    transformers = transformers_module()
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            [
                f"{key}: {path / 'config.json'}: model_type {model_type!r} is not an "
                f"architecture of transformers {transformers.__version__}"
            ]
        )
    return config


def load_tokenizer(path: Path):
    """The directory's own tokenizer (a fast tokenizer; no code from the directory)."""
    transformers = transformers_module()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            [f"model.source: {path}: cannot load its tokenizer: {str(e).splitlines()[0][:300]}"]
        ) from None


def weight_shapes(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each tensor of the directory's safetensors weights: the file holding it and its shape (read
    from the files' headers; one file, or those a sharded index names, each checked)."""
    try:
        files = [path / file for file in weight_files(path)]
    except (OSError, ValueError) as e:
        raise ConfigError([f"model.source: {e}"]) from None
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes.update({key: (file, tuple(f.get_slice(key).get_shape())) for key in f.keys()})  # noqa: SIM118
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ConfigError([f"model.source: {file} is not a readable safetensors file ({e})"]) from None
    return shapes


def read_tensor(file: Path, key: str) -> torch.Tensor:
    """One tensor of a safetensors file. The file is opened for this tensor alone: its pages
    leave the process with it, so reading a large model tensor by tensor never holds it all."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(key)
    except Exception as e:  # a truncated file: safetensors' own error types
        raise ConfigError([f"model.source: {file}: cannot read tensor {key} ({str(e).splitlines()[0]})"]) from None


# -- transformers' names for a checkpoint's tensors ---------------------------------------------
# transformers renames what it reads: a base model's save (BertModel, LlamaModel, sentence-
# transformers' encoders) goes into a model with a head through its base_model_prefix, and a
# headed save into a base model; older names are updated (LayerNorm gamma/beta, GPT-NeoX's
# embed_out, Mixtral's block_sparse_moe, ...); and some stored tensors are converted (experts
# stored one by one are fused into one tensor). kiln asks transformers for that mapping instead
# of keeping a copy of it. It is not public API (PEFT uses get_model_conversion_mapping too):
# these three functions are the only place kiln reaches into it, and
# tests/models/test_hf_loading.py::test_transformers_mapping_is_what_kiln_reads fails loudly
# where it changes.


def _transforms(hf: nn.Module) -> tuple[list[Any], list[Any]]:
    """The renamings and the converters transformers applies when it loads ``hf``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(cast(Any, hf))
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return [t for t in transforms if not isinstance(t, WeightConverter)], converters


def _model_name(key: str, transforms: tuple[list[Any], list[Any]], prefix: str | None, present: dict[str, bool]):
    """The name transformers' loader gives stored tensor ``key`` in a model whose tensors are
    ``present``, and the source pattern of the converter it goes through (None: renamed only)."""
    from transformers.core_model_loading import rename_source_key

    renames, converters = transforms
    name, pattern = rename_source_key(key, renames, converters, prefix, present)
    if name not in present and key in present:  # as the loader does: a name its renames spoil is kept
        name, pattern = rename_source_key(key, [], [], prefix, present)
    return name, pattern


def _convert(converter: Any, layer: str, parts: dict[str, list[torch.Tensor]], hf: nn.Module) -> dict[str, Any]:
    """The model's tensors ``converter`` makes of the stored ``parts`` (by source pattern, each
    list in the loader's order), named in full after ``layer``, the model's name of its first."""
    tensors: dict[str, Any] = dict(parts)
    for op in converter.operations:
        tensors = op.convert(
            tensors,
            source_patterns=converter.source_patterns,
            target_patterns=converter.target_patterns,
            full_layer_name=layer,
            model=hf,
            config=getattr(hf, "config", None),
        )
    anchor = next(target for target in tensors if target in layer)
    before, _, after = layer.partition(anchor)
    return {before + target + after: _one(value) for target, value in tensors.items()}


def _one(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, list) else value


# -------------------------------------------------------------------------------------------------


def _natural(key: str) -> list[tuple[int, int, str]]:
    """A sort key that orders ``experts.10`` after ``experts.9``: the order in which transformers
    hands a converter its tensors."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split(".")]


@dataclass
class Conversion:
    """Stored tensors that become model tensors together (one layer's experts, stored one by one,
    fused into one tensor): the converter, the model's name of its first output, the stored names
    by source pattern, and the shape of each model tensor it makes."""

    converter: Any
    layer: str
    parts: dict[str, list[str]]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadReport:
    """What a model's files gave it: how many of its tensors were read from how many files, which
    were initialised (new by design: a classifier's head; or missing, allowed by the user), and the
    files' tensors it does not use."""

    loaded: int
    files: int
    new: tuple[str, ...]
    missing: tuple[str, ...]
    unused: tuple[str, ...]

    def lines(self) -> list[str]:
        said = f"weights: load {_count(self.loaded, 'tensor')} from {_count(self.files, 'file')}"
        if self.new:
            said += f", initialise {len(self.new)} (classifier head: {_first(self.new)})"
        out = [said]
        if self.missing:
            out.append(
                f"weights: initialise {_count(len(self.missing), 'tensor')} the files lack (model.allow_missing): "
                f"{_first(self.missing)}"
            )
        if self.unused:
            out.append(
                f"weights: the model does not use {_count(len(self.unused), 'tensor')} of the files: "
                f"{_first(self.unused)}"
            )
        return out


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _first(names: tuple[str, ...], shown: int = 4) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def is_head(key: str, base_prefix: str) -> bool:
    """Whether a classifier's tensor ``key`` belongs to its head, which is new when the files have
    none (a base model's save) or another label count: what lies outside its base model, and the
    pooler, which only the head reads (a masked-LM save has none)."""
    outside = bool(base_prefix) and not key.startswith(f"{base_prefix}.")
    return outside or ".pooler." in f".{key}"


class Pretrained(Values):
    """A Hugging Face model's starting values, read tensor by tensor from its safetensors files,
    so that a rank reads only the tensors of what it holds and keeps only its slices of them.

    Every tensor is accounted for. The files' names are mapped onto the model's as transformers
    maps them (``_model_name``; converted tensors, such as experts stored one by one, converted
    as it converts them). Each parameter then comes from the files, or is new by design (with
    ``classifier``: its head, when the files have none or one of another shape, starts as
    ``transformers`` starts it, seeded by its name); anything else the files lack is a
    ConfigError naming the file and the first tensors missing, unless ``allow_missing`` (then
    initialised as a new head is, and listed). A stored tensor of another shape than the model's
    (outside a classifier's head) is a ConfigError. ``report`` says what was loaded, initialised
    and left unused. Buffers keep the values the model's constructor computed (it was built with
    its parameters on ``meta``), unless the model saves them and the files hold them.

    Names: the model's own under kiln's wrapper (``hf.``) and PEFT's (``base_model.model.``)."""

    verb = "loading"
    part = "load"

    def __init__(
        self,
        model: nn.Module,
        directory: Path,
        seed: int,
        hf: nn.Module,
        *,
        classifier: bool,
        allow_missing: bool = False,
    ):
        super().__init__(model, seed)
        self.hf, self.directory = hf, directory
        self.stored = weight_shapes(directory)
        # Allocating the model gives it new buffers: these, the constructor's, stay as they were
        # (unless the files hold one the model saves).
        self.buffers = {name: b.detach() for name, b in model.named_buffers() if not b.is_meta}
        # The loader's names: a tied parameter's both, the buffers the model saves.
        saved = {self.key(name) for name in cast(Any, hf).state_dict()}
        shapes: dict[str, tuple[int, ...]] = {}  # each tensor the files may fill, by its name in transformers' model
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            key = self.key(self.names.get(name, name))
            if lora_kind(name) is None and (isinstance(tensor, nn.Parameter) or key in saved):
                shapes[key] = tuple(tensor.shape)
        params = {self.key(name) for name, _ in model.named_parameters() if lora_kind(name) is None}
        self.sources: dict[str, str | Conversion] = {}
        unused = self._map(saved, shapes)
        found = {key: self._stored_shape(source, key) for key, source in self.sources.items()}
        base = getattr(hf, "base_model_prefix", "") if getattr(hf, "base_model", hf) is not hf else ""
        head = {k for k in params if is_head(k, base)} if classifier else set()
        reshaped = sorted(k for k in found if found[k] != shapes[k])
        if bad := [k for k in reshaped if k not in head]:
            key, file = bad[0], self.file_of(bad[0])
            raise ConfigError(
                [
                    f"model.source: {file}: tensor {self._stored_name(key)} has shape {list(found[key])}, but the "
                    f"model its config.json describes has {list(shapes[key])} ({key})"
                ]
            )
        lacking = sorted(k for k in params if k not in found)
        missing = [k for k in lacking if k not in head]
        if missing and not allow_missing:
            raise ConfigError(
                [
                    f"model.source: {self.weights_file()} lacks {len(missing)} of the model's tensors "
                    f"({_first(tuple(missing))}): it would start from random values; check model.task and the "
                    "directory, or set model.allow_missing=true to initialise them"
                ]
            )
        for key in reshaped:
            del self.sources[key]
        self.new = sorted((set(lacking) | set(reshaped)) - set(missing))
        self.missing = missing
        self.report = LoadReport(
            loaded=len(params) - len(self.new) - len(missing),
            files=len({file for file, _ in self.stored.values()}),
            new=tuple(self.new),
            missing=tuple(missing),
            unused=tuple(sorted(unused)),
        )
        self._converted: dict[str, torch.Tensor] = {}
        # The modules whose tensors start as transformers starts them, copied while still plain (the
        # layout then shards the model in place): their initialisation runs on a copy of them alone.
        initialised = set(self.new) | set(missing)
        owners = {name.rpartition(".")[0] for name, _ in model.named_parameters() if self.key(name) in initialised}
        self._owners = {name: copy.deepcopy(model.get_submodule(name)) for name in owners}

    def _map(self, saved: set[str], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        """Fill ``sources`` (each model tensor's stored tensor or conversion) from the stored names,
        as transformers maps them; return the stored tensors that map to nothing of the model."""
        hf = self.hf
        transforms = _transforms(hf)
        present = dict.fromkeys(saved | shapes.keys(), True)
        prefix = getattr(hf, "base_model_prefix", "") or None
        ignored = getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or ()
        # Buffers the files hold but the model computes (position ids, rotary tables) are not unused.
        buffers = {self.key(name) for name, _ in self.model.named_buffers()}
        buffers |= {f"{prefix}.{name}" for name in buffers} if prefix else set()
        aliases = {self.key(name): self.key(first) for name, first in self.names.items()}
        conversions: dict[str, Conversion] = {}
        unused = []
        for stored in sorted(self.stored, key=_natural):
            name, pattern = _model_name(stored, transforms, prefix, present)
            target = aliases.get(name, name)
            if target not in shapes:
                if (
                    name not in buffers
                    and f"{prefix}.{name}" not in buffers
                    and not any(re.search(p, name) for p in ignored)
                ):
                    unused.append(stored)
                continue
            if pattern is None:
                self.sources.setdefault(target, stored)
                continue
            converter = next(c for c in transforms[1] if pattern in c.source_patterns)
            group = conversions.setdefault(target, Conversion(converter, target, {}))
            group.parts.setdefault(pattern, []).append(stored)
        for group in conversions.values():
            meta = {p: [torch.empty(self.stored[k][1], device="meta") for k in keys] for p, keys in group.parts.items()}
            try:  # on meta tensors: the shapes it makes, before any is read
                converted = _convert(group.converter, group.layer, meta, hf)
            except Exception as e:  # an operation kiln cannot run outside transformers' own loader
                first = next(iter(group.parts.values()))[0]
                raise ConfigError(
                    [
                        f"model.source: {self.stored[first][0]}: transformers converts {first} and the tensors "
                        f"stored with it into {group.layer}, which kiln cannot do tensor by tensor "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                    ]
                ) from None
            group.shapes = {k: tuple(v.shape) for k, v in converted.items()}
            for key in group.shapes:
                self.sources[aliases.get(key, key)] = group
        return unused

    def describe(self) -> list[str]:
        return self.report.lines()

    @staticmethod
    def key(name: str) -> str:
        """The checkpoint's name of the model's tensor ``name``."""
        return plain_name(name).removeprefix("hf.").removeprefix("base_model.model.")

    def weights_file(self) -> Path:
        """The directory's weights file, or its index."""
        index = self.directory / "model.safetensors.index.json"
        return index if index.is_file() else self.directory / "model.safetensors"

    def file_of(self, key: str) -> Path:
        """The file that holds model tensor ``key`` (the first of a conversion's)."""
        return self.stored[self._stored_name(key)][0]

    def _stored_name(self, key: str) -> str:
        source = self.sources[key]
        return source if isinstance(source, str) else next(iter(source.parts.values()))[0]

    def _stored_shape(self, source: str | Conversion, key: str) -> tuple[int, ...]:
        return self.stored[source][1] if isinstance(source, str) else source.shapes[key]

    def base_value(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        key = self.key(name)
        source = self.sources.get(key)
        if source is None:
            return self.buffers[name] if name in self.buffers else self._initialised(name, key)
        if isinstance(source, str):
            return read_tensor(self.stored[source][0], source)
        if key not in self._converted:
            parts = {p: [read_tensor(self.stored[k][0], k) for k in keys] for p, keys in source.parts.items()}
            # A conversion that makes several tensors (a fused projection split) is read once for all of them.
            self._converted = _convert(source.converter, source.layer, parts, self.hf)
        return self._converted.pop(key)

    def _initialised(self, name: str, key: str) -> torch.Tensor:
        """``transformers``' initialisation of the module holding ``name``, on a copy of it alone."""
        owner_name, _, leaf = name.rpartition(".")
        owner = copy.deepcopy(self._owners[owner_name])
        owner.to_empty(device="cpu")
        if self.seed is not None:
            torch.manual_seed(tensor_seed(self.seed, key))
        with torch.no_grad():
            cast(Any, self.hf)._init_weights(owner)
        return getattr(owner, leaf).detach()
