"""Initial weights keyed by name: every tensor's initial values come from the run's seed and the
tensor's own name, never from how many random numbers were drawn before it.

That is what lets a rank initialise only its own shards of a model that was built on the
``meta`` device and split before any memory was allocated (``kiln.distributed`` does the
splitting): the values of ``blocks.7.mlp.w1.weight`` are the same whether one process builds the
whole model or rank 3 of 8 fills a slice of that one parameter, so the same seed gives bitwise the
same initial model under every layout.

A model takes part by having ``init_tensor(name, shape, generator) -> Tensor``: the whole initial
value of its parameter or buffer ``name`` (its first name, for one the model holds under two), of
``shape``, drawn from ``generator`` alone. kiln's GPT has it. Low-rank adapters (PEFT's LoRA,
injected into a model) follow PEFT's own initialisation here, and the layer they wrap keeps its
name's values. A Hugging Face model's values come from its files instead
(``kiln.models.hf.loading.Pretrained``), through the same ``Values.fill``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Callable, Iterator
from typing import Protocol, cast

import torch
from torch import nn

# PEFT's LoRA moves the wrapped layer's weight under ``base_layer`` and adds its adapters under
# ``lora_A.<adapter>`` and ``lora_B.<adapter>``.
_BASE = ".base_layer"


class _NamedInit(Protocol):
    def init_tensor(self, name: str, shape: torch.Size, generator: torch.Generator | None) -> torch.Tensor: ...


def keyed(model: nn.Module) -> bool:
    """Whether ``model`` initialises its tensors by name (see the module's docstring)."""
    return hasattr(model, "init_tensor")


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` in a run of seed ``seed``: 63 bits of a hash of both."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def first_names(model: nn.Module) -> dict[str, str]:
    """Each name of each parameter and buffer of ``model`` to the tensor's first name: a tied
    weight gets the values of its first name wherever it lives (a pipeline's last stage holds the
    tied output layer without the embedding it shares)."""
    first: dict[int, str] = {}
    names = {}
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        names[name] = first.setdefault(id(tensor), name)
    return names


def allocate(module: nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)`` (storage, no values), with a weight it holds under two
    names (a tied embedding) still one tensor: ``to_empty`` replaces plain parameters module by
    module, which unties them (a sharded one, a DTensor, is swapped in place and stays tied)."""
    seen: dict[int, str] = {}
    shared = [
        (name, seen[id(param)])
        for name, param in module.named_parameters(remove_duplicate=False)
        if seen.setdefault(id(param), name) != name
    ]
    module.to_empty(device=device)
    for name, first in shared:
        owner, _, leaf = name.rpartition(".")
        holder, weight = module.get_submodule(owner), module.get_parameter(first)
        if getattr(holder, leaf) is not weight:
            setattr(holder, leaf, weight)


class Values:
    """The starting value of each tensor of a model, by name: how a rank fills the shards it holds
    of a model built without storage (``fill``). ``model`` is the whole model, built under
    ``params_on_meta`` (only its names, shapes and buffers are read); a LoRA adapter's tensors
    start as PEFT starts them, from ``seed`` and their name."""

    # What ``fill`` does, for a progress display and the setup line: random values are made, a
    # model's files are read.
    verb = "initialising"
    part = "initialise"

    def __init__(self, model: nn.Module, seed: int | None):
        self.model, self.seed = model, seed
        self.names = first_names(model)
        # ``progress(what, total)``: a context whose value is called once per tensor filled (a
        # progress bar's; the run sets it on its main rank's terminal).
        self.progress: Callable[[str, int], contextlib.AbstractContextManager[Callable[[], None]]] = _no_progress

    def describe(self) -> list[str]:
        """Lines for the console about where the values come from (none for random ones)."""
        return []

    def like(self, name: str) -> torch.Tensor:
        """The model's tensor ``name`` (on ``meta`` for a parameter): its shape and dtype."""
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            return self.model.get_buffer(name)

    def generator(self, key: str) -> torch.Generator | None:
        """The generator of tensor ``key``'s values; without a seed, PyTorch's global one (drawn in
        the order the tensors are filled)."""
        return None if self.seed is None else torch.Generator().manual_seed(tensor_seed(self.seed, key))

    def value(self, name: str) -> torch.Tensor:
        """The whole starting value of the tensor ``name`` (its first name), on the CPU."""
        like, key = self.like(name), plain_name(name)
        if kind := lora_kind(name):
            return _lora(kind, like.shape, self.generator(key))
        return self.base_value(name, key, like)

    def base_value(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        """The value of a tensor of the model itself (not an adapter's): ``name`` in the model,
        ``key`` its name without LoRA's wrappers."""
        raise NotImplementedError

    def materialize(
        self,
        module: nn.Module,
        device: torch.device | str,
        place: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """Allocate ``module`` (built with its parameters on ``meta``) on ``device`` and ``fill`` it."""
        allocate(module, device)
        self.fill(module, place)

    @torch.no_grad()
    def fill(self, module: nn.Module, place: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Write every parameter's and buffer's starting value into ``module`` (the model, or a
        part of it that keeps the model's names), through ``place(tensor, value)``: by default a
        copy; ``kiln.distributed`` passes one that copies a shard's slice of the value."""
        place = place or _copy
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        with self.progress(f"{self.verb} weights", len(tensors)) as advance:
            for name, tensor in tensors:
                place(tensor, self.value(self.names.get(name, name)))
                advance()


class Initial(Values):
    """Random starting values from the seed and each tensor's name, drawn by the model's own
    ``init_tensor``."""

    def base_value(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        return cast(_NamedInit, self.model).init_tensor(key, like.shape, self.generator(key))


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules constructed inside get their parameters on the ``meta`` device (shapes, no storage)
    and keep real buffers, which their constructors compute (rotary tables, position ids).

    PyTorch has no public switch for this (``torch.device("meta")`` moves buffers too): every
    parameter passes through ``nn.Module.register_parameter``, which is wrapped for the duration,
    as Accelerate's ``init_empty_weights`` does. A parameter is created on the CPU first, without
    values (``torch.empty``), and moved at once. ``tests/models/test_hf_loading.py`` fails if a
    module built inside keeps a parameter off ``meta``."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# PEFT keeps a classifier head it trains (``modules_to_save``) as ``original_module`` beside a copy
# per adapter; both start as the head.
_PEFT_COPIES = re.compile(r"\.(original_module|modules_to_save\.[^.]+)(?=\.)")


def plain_name(name: str) -> str:
    """The name a tensor has in the model without LoRA: PEFT moves a wrapped layer's weight under
    ``base_layer`` and keeps copies of a trained head."""
    return _PEFT_COPIES.sub("", name.replace(_BASE, ""))


def lora_kind(name: str) -> str | None:
    """``lora_A`` or ``lora_B`` for a LoRA adapter's tensor, else None."""
    owner = f".{name.rpartition('.')[0]}."
    return next((kind for kind in ("lora_A", "lora_B") if f".{kind}." in owner), None)


@contextlib.contextmanager
def _no_progress(what: str, total: int) -> Iterator[Callable[[], None]]:
    yield lambda: None


def _copy(tensor: torch.Tensor, value: torch.Tensor) -> None:
    tensor.copy_(value)


def _lora(kind: str, shape: torch.Size, generator: torch.Generator | None) -> torch.Tensor:
    """PEFT's default LoRA initialisation: A as ``nn.Linear``'s (Kaiming-uniform, a = sqrt(5)), B zero,
    so that the adapted layer starts out computing what the base layer computes."""
    if kind == "lora_B":
        return torch.zeros(shape)
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)
