"""A local Hugging Face model directory, read safely: its config, weights and tokenizer.

Nothing is downloaded (``local_files_only``, and the hub is told it is offline) and no code from
the directory runs (``trust_remote_code`` stays off: a model whose config maps to its own Python
classes is refused). Weights are read from safetensors only, one file or a sharded index.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

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


def read_config(path: Path) -> dict[str, Any]:
    """config.json as a dict, refused if it needs code from the directory or an unknown architecture."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"model.source: {path / 'config.json'} is not readable JSON: {e}"]) from None
    if config.get("auto_map"):
        raise ConfigError(
            [
                f"model.source: {path} needs its own Python code (config.json has auto_map, i.e. "
                "trust_remote_code); kiln never runs code from a model directory"
            ]
        )
    model_type = config.get("model_type")
    transformers = transformers_module()
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            [
                f"model.source: {path / 'config.json'}: model_type {model_type!r} is not an "
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


# What transformers renames when it loads older checkpoints (its conversion mapping): Mixtral's
# mixture of experts is "block_sparse_moe" in the files and "mlp" in the model.
RENAMED_MODULES = ((".mlp.", ".block_sparse_moe."),)
# transformers computes a mixture of experts with each layer's experts fused into 3-D tensors
# ([experts, rows, columns]); checkpoints store them one expert at a time. Each fused tensor's
# name, and the names (Qwen-MoE's, Mixtral's) of the per-expert weights whose rows it stacks.
FUSED_EXPERTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def stored_names(key: str) -> list[str]:
    """The names the model's tensor ``key`` may have in a checkpoint: its own, then older ones."""
    return [key] + [key.replace(new, old, 1) for new, old in RENAMED_MODULES if new in key]


def expert_parts(key: str, experts: int, stored: Mapping[str, Any]) -> list[list[str]] | None:
    """The stored per-expert tensors whose rows make up the fused experts tensor ``key`` (for each
    of its ``experts``, in order), or None if ``key`` is not one or ``stored`` lacks them."""
    module, _, leaf = key.rpartition(".")
    for prefix in stored_names(module) if module.endswith(".experts") else []:
        for weights in FUSED_EXPERTS.get(leaf, ()):
            parts = [[f"{prefix}.{e}.{w}.weight" for w in weights] for e in range(experts)]
            if all(k in stored for expert in parts for k in expert):
                return parts
    return None


class Pretrained(Values):
    """A Hugging Face model's starting values, read tensor by tensor from its safetensors files,
    so that a rank reads only the tensors of what it holds and keeps only its slices of them.

    Names: the model's own under kiln's wrapper (``hf.``) and PEFT's (``base_model.model.``).
    Buffers keep the values the model's constructor computed (it was built with its parameters on
    ``meta``). ``missing``: the model's parameters the files lack. With ``new_head`` (a
    classifier: its head is new when its labels differ), those and the ones the files hold in
    another shape start as ``transformers`` starts them (``init_module``: the model's own
    initialisation of one module), seeded by their name, and are listed in ``new``; otherwise a
    shape that differs is a ConfigError naming the file and tensor."""

    verb = "loading"

    def __init__(
        self,
        model: nn.Module,
        directory: Path,
        seed: int,
        init_module: Callable[[nn.Module], None],
        *,
        new_head: bool,
    ):
        super().__init__(model, seed)
        self.init_module = init_module
        self.stored = weight_shapes(directory)
        # Allocating the model gives it new buffers: these, the constructor's, stay as they were.
        self.buffers = {name: b.detach() for name, b in model.named_buffers() if not b.is_meta}
        params = {self.key(name): p for name, p in model.named_parameters() if lora_kind(name) is None}
        # Each parameter's stored tensor, or those of each expert of fused experts.
        self.sources: dict[str, str | list[list[str]]] = {}
        for key, param in params.items():
            found = next((name for name in stored_names(key) if name in self.stored), None)
            if source := found or expert_parts(key, param.shape[0], self.stored):
                self.sources[key] = source
        shapes = {key: self._stored_shape(parts) for key, parts in self.sources.items()}
        self.missing = sorted(params.keys() - shapes.keys())
        reshaped = sorted(k for k in params.keys() & shapes.keys() if shapes[k] != tuple(params[k].shape))
        if reshaped and not new_head:
            key = reshaped[0]
            source = self.sources[key]
            file = self.stored[source if isinstance(source, str) else source[0][0]][0]
            raise ConfigError(
                [
                    f"model.source: {file}: tensor {key} has shape {list(shapes[key])}, but the model its config.json "
                    f"describes has {list(params[key].shape)}"
                ]
            )
        self.new = sorted(set(self.missing) | set(reshaped)) if new_head else []

    @staticmethod
    def key(name: str) -> str:
        """The checkpoint's name of the model's tensor ``name``."""
        return plain_name(name).removeprefix("hf.").removeprefix("base_model.model.")

    def base_value(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        if name in self.buffers:
            return self.buffers[name]
        key = self.key(name)
        if key in self.new or key not in self.sources:
            return self._initialised(name, key)
        source = self.sources[key]
        if isinstance(source, str):
            return self._read(source)
        return torch.stack([torch.cat([self._read(k) for k in expert]) for expert in source])

    def _read(self, name: str) -> torch.Tensor:
        return read_tensor(self.stored[name][0], name)

    def _stored_shape(self, source: str | list[list[str]]) -> tuple[int, ...]:
        """The shape of the tensor read from ``source``: a stored one's, or fused experts' [experts,
        their rows, columns]."""
        if isinstance(source, str):
            return self.stored[source][1]
        first = [self.stored[k][1] for k in source[0]]
        return (len(source), sum(shape[0] for shape in first), *first[0][1:])

    def _initialised(self, name: str, key: str) -> torch.Tensor:
        """``transformers``' initialisation of the module holding ``name``, on a copy of it alone."""
        owner_name, _, leaf = name.rpartition(".")
        owner = copy.deepcopy(self.model.get_submodule(owner_name))
        owner.to_empty(device="cpu")
        if self.seed is not None:
            torch.manual_seed(tensor_seed(self.seed, key))
        with torch.no_grad():
            self.init_module(owner)
        return getattr(owner, leaf).detach()
