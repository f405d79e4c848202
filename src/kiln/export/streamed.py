"""``--format hf|safetensors`` of a run saved in shards, from one process that never holds its model.

A sharded checkpoint (FSDP, tensor or pipeline parallel) is what a model too large for one
process leaves, so its export reads it the way it was trained: in parts. The model is built on
``meta`` (names and shapes, no storage) and its tensors are taken in units: each repeated layer,
then everything else (embeddings, final norm, output layer: the exception to "one layer's
worth", a vocabulary embedding being one tensor). A unit is read whole from the checkpoint, its
LoRA adapters folded in (for ``hf``), renamed, written and freed before the next is read. The
files' layout (``kiln.checkpoint.weights``) is planned first from the same units, allocated
without being read, so that each tensor streams in behind a header already written.

Checks, in ``export.json``: every tensor is read back through ``safetensors`` and compared bit
for bit with what was computed; and the logits of the exported model (through ``transformers``
for ``hf``) are compared with the trained model's on the run's validation inputs, both models cut
to a sample of their layers (the first and the last, with the embeddings and the output layer):
the whole of either may not fit in this process.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import json
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from kiln.checkpoint import CheckpointError
from kiln.checkpoint.sharded import ShardedModel
from kiln.checkpoint.weights import Entry, Layout, StreamWriter, read_weights
from kiln.export.check import Inputs, logit_difference
from kiln.export.hf import write_tokenizer
from kiln.export.weights import copy_run_files
from kiln.io import WEIGHTS, weight_files
from kiln.models.hf.loading import transformers_module
from kiln.models.init import params_on_meta
from kiln.train.apply import fold_lora, merge_lora
from kiln.train.jobs import FamilyJob

Unit = list[str]  # state-dict names read and written together
Values = dict[str, torch.Tensor]


def export_streamed(
    job: FamilyJob, run_dir: Path, checkpoint: Path, fmt: str, out: Path, max_shard_size: int, inputs: Inputs
) -> dict[str, Any]:
    """Write ``checkpoint`` (sharded, of the run in ``run_dir``) into ``out`` in ``fmt`` (hf or
    safetensors); the checks, for ``export.json``."""
    args, skeleton = job.saved_skeleton(run_dir)
    source = ShardedModel(checkpoint)
    blocks = job.family.parallel_plan(args).repeated_blocks(skeleton)
    units = _units(skeleton, blocks, set(source.tensors))
    rename = _hf_names(job, args, skeleton) if fmt == "hf" else None

    def tensors(read: Callable[[Unit], Values]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each unit's tensors as they are written: read into a working copy of the skeleton,
        adapters folded in for ``hf`` (the repeated layers first, so that the rest is what folds
        last), renamed, and dropped again. Folding keeps the base weights' tensors (it adds to
        them), so what the unit holds afterwards is told by identity: the files' layout is
        planned from the same steps run on ``meta``."""
        work = copy.deepcopy(skeleton)
        parts = [*_same_modules(skeleton, work, blocks), work]
        for unit, part in zip(units, parts, strict=True):
            given = _put(work, read(unit))
            if rename is not None:
                fold_lora(part)
            held = {n: t.detach() for n, t in _first_names(work).items() if id(t) in given}
            yield from (rename(held) if rename is not None else held).items()
            _put(work, {name: t.to("meta") for name, t in held.items()})
            _return_freed_memory()

    planned = [Entry(name, tuple(t.shape), t.dtype) for name, t in tensors(lambda u: source.empty(u, "meta"))]
    writer = StreamWriter(out, Layout.plan(planned, max_shard_size))
    for name, tensor in tensors(source.read):
        writer.write(name, tensor)
    files = writer.close()
    if fmt == "hf":
        _write_hf_files(job, args, skeleton, source, _main_dtype(planned), out)
        write_tokenizer(job.saved_tokenizer(run_dir), out)
    else:
        copy_run_files(run_dir, out)
    verified = writer.verify()

    layers = len(units) - 1
    sample = sorted({0, layers - 1}) if layers else []
    reference = _cut(_filled(skeleton, source.read(_sampled(units, sample))), layers, sample)
    artifact = _hf_artifact(job, args, out, layers, sample) if fmt == "hf" else _own_artifact(job, out, layers, sample)
    batches = [inputs.batch(2), inputs.batch(3, max(2, inputs.seq_len // 2))]
    return {
        "check": {
            "inputs": inputs.source,
            "shapes": [list(b.shape) for b in batches],
            "layers": sample,
            "of_layers": layers,
            "why": "saved in shards, the model is exported one layer at a time: its logits are compared "
            "on a sample of its layers (with the embeddings and the output layer), and every tensor "
            "written is read back and compared bit for bit",
        },
        fmt: {**logit_difference(reference, artifact, batches), "tensors_verified": verified},
        "streamed": {"files": files, "max_shard_size": max_shard_size},
    }


def _return_freed_memory() -> None:
    """Give the pages of the unit just freed back to the system. glibc's allocator keeps freed
    blocks below its mmap threshold (which rises to 32 MB as larger blocks are freed) in its
    heaps, where they go on counting in the process's resident memory and the next unit's tensors
    need not fit in them: without this a 2 GB model's export peaked at 1.6 GB (1.5 GB of it heap),
    with it at 0.76 GB. A no-op where the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to open by None (Windows)
        return None


def _same_modules(model: nn.Module, copied: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``copied`` (a deep copy of ``model``) that are ``modules`` in ``model``."""
    names = {id(m): name for name, m in model.named_modules()}
    return [copied.get_submodule(names[id(m)]) for m in modules]


def _units(model: nn.Module, blocks: list[nn.Module], saved: set[str]) -> list[Unit]:
    """The state-dict names of each repeated layer, in order, then those of the rest: each tensor
    once, under a name the checkpoint has (a tied weight may be saved under one of its names)."""
    prefixes = {id(m): f"{name}." for name, m in model.named_modules()}
    starts = [prefixes[id(b)] for b in blocks]
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    units: list[Unit] = [[] for _ in range(len(starts) + 1)]
    for names in groups.values():
        name = next((n for n in names if n in saved), names[0])  # a missing one fails when read, by name
        units[next((i for i, s in enumerate(starts) if name.startswith(s)), len(starts))].append(name)
    return units


def _sampled(units: list[Unit], sample: list[int]) -> Unit:
    return [name for i in sample for name in units[i]] + units[-1]


def _put(model: nn.Module, values: Values) -> set[int]:
    """Make ``values`` (by state-dict name) the model's tensors, in place: a tied weight, named
    by any of its names, under all of them; a parameter stays a parameter (frozen). The ids of
    the tensors placed."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(id(tensor), []).append(name)
    placed = set()
    for names in groups.values():
        given = next((values[n] for n in names if n in values), None)
        if given is None:
            continue
        old = tensors[names[0]]
        if given.shape != old.shape:
            raise CheckpointError(
                f"tensor {names[0]!r} is {tuple(given.shape)} in the checkpoint, {tuple(old.shape)} in the model"
            )
        new = nn.Parameter(given, requires_grad=False) if isinstance(old, nn.Parameter) else given
        placed.add(id(new))
        for name in names:
            owner, _, leaf = name.rpartition(".")
            # nn.Module's own assignment: a Parameter replaces the parameter, a tensor the buffer
            # (which stays persistent or not as it was).
            setattr(model.get_submodule(owner), leaf, new)
    return placed


def _filled(skeleton: nn.Module, values: Values) -> nn.Module:
    """A copy of ``skeleton`` holding ``values``, in the dtypes it was built in (a check computes
    in the precision the model was built in), its other tensors without storage."""
    model = copy.deepcopy(skeleton)
    built = model.state_dict(keep_vars=True)
    _put(model, {name: t.to(built[name].dtype) if name in built else t for name, t in values.items()})
    return model


def _first_names(model: nn.Module) -> Values:
    """The model's state-dict tensors (parameters as they are), each once: a tied one under its first name."""
    first: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), (name, tensor))
    return dict(first.values())


def _hf_names(job: FamilyJob, args: Any, skeleton: nn.Module) -> Callable[[Values], Values]:
    """kiln's names of a model whose adapters are folded in, to those of its ``transformers``
    equivalent: PEFT's wrapper of a ``transformers`` model dropped, the family's names mapped."""
    adapter = job.family.state_dict_adapter(args)
    if adapter is None:
        raise CheckpointError(f"model family {job.cfg.model.family!r} has no Hugging Face equivalent to export to")
    wrapper, wrapped, unwrapped = job.family.transformers_model(skeleton), "", ""
    if wrapper is not None and hasattr(wrapper, "get_base_model"):
        names = {id(m): name for name, m in skeleton.named_modules()}
        wrapped, unwrapped = (_prefix(names[id(m)]) for m in (cast(Any, wrapper).get_base_model(), wrapper))

    def rename(state: Values) -> Values:
        if wrapped:
            state = {unwrapped + n.removeprefix(wrapped) if n.startswith(wrapped) else n: t for n, t in state.items()}
        return adapter.to_hf(state)

    return rename


def _prefix(path: str) -> str:
    return f"{path}." if path else ""


def _main_dtype(entries: list[Entry]) -> torch.dtype:
    """The dtype most of the bytes are in: the one ``config.json`` names."""
    sizes: dict[torch.dtype, int] = {}
    for e in entries:
        sizes[e.dtype] = sizes.get(e.dtype, 0) + e.nbytes
    return max(sizes, key=lambda d: sizes[d])


def _write_hf_files(
    job: FamilyJob, args: Any, skeleton: nn.Module, source: ShardedModel, dtype: torch.dtype, out: Path
) -> None:
    """config.json (and a generation config) as ``save_pretrained`` writes them; with LoRA on a
    ``transformers`` model, the adapter in PEFT's format under ``adapter/``."""
    family = job.family
    wrapped = family.transformers_model(skeleton)
    if wrapped is None:
        adapter = family.state_dict_adapter(args)
        assert adapter is not None  # checked by _hf_names
        config = {**adapter.hf_config(), "torch_dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return
    plain = cast(Any, family.transformers_model(merge_lora(skeleton, family)))
    saved = copy.deepcopy(plain.config)
    saved.dtype = dtype
    saved.save_pretrained(out)
    if plain.can_generate() and getattr(plain, "generation_config", None) is not None:
        plain.generation_config.save_pretrained(out)
    if hasattr(wrapped, "merge_and_unload"):  # PEFT's model: its adapter's tensors are few
        names = [n for n in skeleton.state_dict(keep_vars=True) if "lora_" in n or "modules_to_save" in n]
        adapter = family.state_dict_adapter(args)
        assert adapter is not None
        cast(Any, wrapped).save_pretrained(out / "adapter", state_dict=adapter.to_hf(source.read(names)))


def _layers(model: nn.Module, count: int) -> tuple[nn.Module, str, nn.ModuleList] | None:
    """The ModuleList of the model's ``count`` repeated layers (the one of that length with the
    most parameters), its parent and its name there."""
    best, size = None, -1
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                parent, _, name = path.rpartition(".")
                best, size = (model.get_submodule(parent), name, module), n
    return best


def _cut(model: nn.Module, count: int, sample: list[int]) -> nn.Module:
    """``model`` (in eval mode) with only the ``sample`` of its ``count`` repeated layers."""
    found = _layers(model, count) if count else None
    if found is not None:
        parent, name, layers = found
        setattr(parent, name, nn.ModuleList(layers[i] for i in sample))
    return model.eval()


def _sample_names(model: nn.Module, count: int, sample: list[int]) -> set[str]:
    """The state-dict names of ``model`` outside its repeated layers and in the ``sample`` of them."""
    names = set(model.state_dict(keep_vars=True))
    prefixes = {id(m): f"{p}." for p, m in model.named_modules()}
    found = _layers(model, count) if count else None
    if found is None:
        return names
    start = prefixes[id(found[2])]
    keep = tuple(f"{start}{i}." for i in sample)
    return {n for n in names if not n.startswith(start) or n.startswith(keep)}


def _own_artifact(job: FamilyJob, out: Path, count: int, sample: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    skeleton = job.saved_skeleton(out)[1]
    values = read_weights(out, _sample_names(skeleton, count, sample))
    return _cut(_filled(skeleton, values), count, sample)


def _hf_artifact(
    job: FamilyJob, args: Any, out: Path, count: int, sample: list[int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exported directory as ``transformers`` builds it from its config.json, holding the
    sampled layers' tensors read from its files."""
    transformers = transformers_module()
    auto = (
        transformers.AutoModelForSequenceClassification
        if job.cfg.model.task == "sequence_classification"
        else transformers.AutoModelForCausalLM
    )
    config = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
    with params_on_meta():
        skeleton = auto.from_config(config, dtype=torch.float32)
    names, stored = _sample_names(skeleton, count, sample), _stored_names(out)
    adapter = job.family.state_dict_adapter(args)
    cut = adapter.cut_config(sample) if adapter is not None else None
    if names - stored and cut is not None:
        # The files name tensors other than the model does (an MoE's experts, one tensor each
        # there, fused as transformers 5 loads them): transformers loads the sampled layers itself.
        model = _loaded_cut(auto, out, stored, cut, sample)
    else:
        model = _cut(_filled(skeleton, read_weights(out, names)), count, sample)
    if job.cfg.model.task == "sequence_classification":
        return lambda ids: model(input_ids=ids).logits
    return lambda ids: model(input_ids=ids, use_cache=False).logits


def _loaded_cut(auto: Any, out: Path, stored: set[str], config: dict[str, Any], sample: list[int]) -> nn.Module:
    """The export's model as ``auto.from_pretrained`` loads it when cut to the ``sample`` of its
    layers: their tensors (renumbered from 0) and the rest, from ``out``'s files (which hold
    ``stored``), into a directory of their own with ``config`` (the cut model's), read by
    transformers with its own name conversions."""
    from safetensors.torch import save_file

    layer = re.compile(r"\.layers\.(\d+)\.")
    renumbered = {str(old): str(new) for new, old in enumerate(sample)}
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        kept = {}
        for name in stored:
            found = layer.search(name)
            if found and found.group(1) not in renumbered:
                continue
            kept[name] = layer.sub(lambda m: f".layers.{renumbered[m.group(1)]}.", name, count=1) if found else name
        values = read_weights(out, set(kept))
        save_file({kept[name]: t.contiguous() for name, t in values.items()}, str(Path(tmp) / WEIGHTS))
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = auto.from_pretrained(tmp, local_files_only=True, dtype=torch.float32)
    return model.eval()


def _stored_names(directory: Path) -> set[str]:
    """The names of the tensors in ``directory``'s safetensors files (read from their headers)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in weight_files(directory):
        with safe_open(str(directory / file), framework="pt") as f:
            names.update(f.keys())  # noqa: SIM118 (safe_open is not a Mapping)
    return names
