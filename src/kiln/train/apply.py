"""Features applied to a plain model from outside: the model file knows nothing of them."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from kiln.compat import quiet_library_imports, quiet_library_warnings
from kiln.config import Config, ConfigError
from kiln.device import resolve_device
from kiln.distributed.parallel import local_part
from kiln.models.family import ModelFamily, ParallelPlan

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

# Weights per absmax scale of an NF4 weight, and scales per group of the scales' own 8-bit
# quantization: QLoRA's (Dettmers et al., 2023) and torchtune's.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256


def apply_activation_checkpointing(
    model: nn.Module, plan: ParallelPlan | None = None, *, selective: bool = False, every: int = 1
) -> nn.Module:
    """Recompute each repeated layer's activations during backward instead of keeping them; with
    ``selective``, only those of cheap operations (``_saved_ops``' outputs are kept); of every
    ``every``-th layer (the first, then each ``every`` later), the others keeping theirs.

    The layers are the plan's (by default: the model's ``blocks``). Each one's ``forward`` is
    replaced on the instance, so parameter names and state dicts stay exactly those of the plain
    model (checkpoints stay interchangeable with and without it).
    """
    blocks = (plan or ParallelPlan.infer(model)).repeated_blocks(model)
    if not blocks:
        raise ValueError(
            "train.activation_checkpointing: the model must expose its repeated layers as an "
            f"nn.ModuleList named `blocks` (or a model family's plan must name them); {type(model).__name__} has none"
        )
    options: dict[str, Any] = {"use_reentrant": False}
    if selective:
        options["context_fn"] = _keep_products
    for block in blocks[::every]:
        block.forward = functools.partial(checkpoint, block.forward, **options)
    return model


@functools.cache
def _saved_ops() -> frozenset:
    """The operations whose outputs selective checkpointing keeps: matrix products and attention
    (the costly ones to recompute; what torchtitan's op-level policy keeps)."""
    aten = torch.ops.aten
    ops = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default]
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):  # fmt: skip
        if hasattr(aten, name):
            ops.append(getattr(aten, name).default)
    return frozenset(ops)


def _keep_products() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The contexts of one checkpointed forward (and its recomputation) under the selective policy."""
    return create_selective_checkpoint_contexts(_keep_product_outputs)


def _keep_product_outputs(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def apply_lora(model: nn.Module, cfg: Config, family: ModelFamily, args: Any, *, quantize: bool = True) -> nn.Module:
    """Low-rank adapters (PEFT's LoRA) when ``lora.rank`` is set: the base weights freeze and only
    the adapters (and a classifier's new head) train. The ``transformers`` model a family wraps
    (``family.transformers_model``) becomes a PEFT model, whose adapter saves in PEFT's own format;
    any other model (kiln's GPT) keeps its class, with the adapted layers replaced in place, so its
    family's parallel plan and calling convention still apply. The family (of arguments ``args``)
    names the modules to adapt by default.
    With ``lora.quantize_base`` the adapted layers' frozen weights are then quantized (QLoRA),
    unless ``quantize`` is False: a model to load a QLoRA checkpoint into for use (its base is
    saved dequantized, and computes in full precision exactly what the 4-bit one computed; a
    base quantized anew from those values would not be the trained one, see ``quantize_base``)."""
    lora = cfg.lora
    if not lora.rank:
        return model
    quiet_library_imports()  # peft imports torchao
    try:
        import peft
    except ImportError:
        raise ConfigError(["lora.rank: LoRA needs the peft package: pip install 'kiln[hf]'"]) from None
    targets = [name.strip() for name in lora.target_modules.split(",") if name.strip()] or family.lora_targets(args)
    if not targets:
        raise ConfigError(
            ["lora.target_modules: this model has no default; name the modules to adapt, e.g. q_proj,v_proj"]
        )
    hf = family.transformers_model(model)
    task = {"sequence_classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}.get(cfg.model.task) if hf else None
    modules, parameters = _split_targets(hf, targets) if hf is not None else (targets, [])
    if parameters and lora.dropout:
        raise ConfigError(
            [
                f"lora.dropout: {lora.dropout}, but PEFT adapts the expert weights {', '.join(parameters)} "
                "(lora.target_modules) without dropout; set lora.dropout=0"
            ]
        )
    if parameters and cfg.parallel.ep > 1:
        raise ConfigError(
            [
                f"lora.target_modules: adapters on the expert weights {', '.join(parameters)} are not split over the "
                "expert-parallel ranks with them; adapt the other layers, or set parallel.ep=1"
            ]
        )
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates it int; a float works (scaling = alpha / r)
        lora_dropout=lora.dropout,
        target_modules=modules,
        target_parameters=parameters or None,
        task_type=task,
        # GPT-2's Conv1D layers keep their weight [in, out]; PEFT would say so and set this itself.
        fan_in_fan_out=hf is not None and _adapts_conv1d(hf, targets),
    )
    try:
        if hf is not None:
            with quiet_library_warnings():
                model.hf = peft.get_peft_model(hf, config)
        else:
            peft.inject_adapter_in_model(config, model)
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name)
    except ValueError as e:
        raise ConfigError([f"lora.target_modules: {str(e).splitlines()[0]}"]) from None
    head = cast(Any, model.hf).get_output_embeddings() if hf is not None else getattr(model, "lm_head", None)
    if hasattr(head, "lora_A") and getattr(model, "fused", True):
        # The fused loss multiplies by the output layer's weight itself: an adapter there would
        # stay at its initial zero, untrained, without a word.
        raise ConfigError(
            [
                "lora.target_modules: the output layer is adapted, but the fused loss reads its weight directly "
                "and its adapter would never train; leave the output layer (lm_head) out"
            ]
        )
    if quantize and lora.quantize_base == "nf4":
        # On the run's device: a GPU quantizes a large model far faster than the host.
        quantize_base(model, resolve_device(cfg.run.device))
    return model


def _matches(name: str, target: str) -> bool:
    """PEFT's matching of a target: a module's (or parameter's) name, or the end of its path."""
    return name == target or name.endswith(f".{target}")


def _adapts_conv1d(model: nn.Module, targets: list[str]) -> bool:
    """Whether ``targets`` pick ``transformers``' Conv1D layers (GPT-2's linear layers, their
    weight stored transposed)."""
    return any(
        type(module).__name__ == "Conv1D" and any(_matches(name, t) for t in targets)
        for name, module in model.named_modules()
    )


def _split_targets(model: nn.Module, targets: list[str]) -> tuple[list[str], list[str]]:
    """``targets`` as PEFT takes them: the modules to adapt, and the parameters: those that name a
    mixture of experts' fused expert weights ([experts, out, in] parameters, e.g. Qwen3-MoE's and
    Mixtral's ``gate_up_proj`` and ``down_proj``), which no linear layer holds. A name can be both
    (``down_proj`` of dense layers and of experts)."""
    fused = [name for name, p in model.named_parameters() if p.dim() == 3]
    parameters = [t for t in targets if any(_matches(name, t) for name in fused)]
    modules = [t for t in targets if t not in parameters or any(_matches(name, t) for name, _ in model.named_modules())]
    return modules, parameters


def _nf4() -> tuple[Any, Any]:
    """torchao's NF4 tensor class and constructor (under ``torchao.dtypes`` up to 0.17)."""
    quiet_library_imports()
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError:
            raise ConfigError(["lora.quantize_base: nf4 needs torchao: pip install 'kiln[hf]'"]) from None
    return NF4Tensor, to_nf4


def quantize_base(model: nn.Module, device: torch.device) -> None:
    """QLoRA: the frozen weight of every LoRA-adapted linear layer becomes torchao's NF4 tensor
    (4-bit NormalFloat codes, an absmax scale per ``NF4_BLOCK`` weights, the scales themselves
    quantized to 8 bits), which ``F.linear`` dequantizes on the fly to the input's dtype; the
    adapters, biases and every other weight keep their precision. Quantized on ``device``, then
    put back where the weight was.

    The layer's state dict holds the weight dequantized, on the host (sharded by FSDP: this
    rank's rows, as a DTensor), so checkpoints and exports see plain tensors; loading one back
    keeps the 4-bit weight when the values are the ones it dequantizes to (a resume, which
    quantizes the same source weights again, continues bit for bit: NF4 of dequantized NF4 is
    not the same NF4), and quantizes them otherwise."""
    to_nf4 = _nf4()[1]
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        base = module.get_base_layer()
        where = f"lora.quantize_base: {name}"
        if not isinstance(base, nn.Linear):
            raise ConfigError([f"{where} is a {type(base).__name__}; nf4 quantizes linear layers only"])
        weight = base.weight
        if len(owners[id(weight)]) > 1:
            raise ConfigError(
                [f"{where}.weight is shared with {owners[id(weight)][0]} (tied); leave it out of lora.target_modules"]
            )
        if weight.numel() % NF4_BLOCK:
            raise ConfigError(
                [f"{where}.weight has {weight.numel()} elements, not a multiple of NF4's block of {NF4_BLOCK}"]
            )
        # A small layer has fewer scales than a group: they go in the largest power of two that divides them.
        scaler_block = math.gcd(weight.numel() // NF4_BLOCK, NF4_SCALER_BLOCK)
        quantized = to_nf4(weight.detach().to(device), NF4_BLOCK, scaler_block).to(weight.device)
        base.weight = nn.Parameter(quantized, requires_grad=False)
        base.register_state_dict_post_hook(_dequantized_state)
        base.register_load_state_dict_pre_hook(_load_quantized)


def check_quantized_shards(model: nn.Module, ranks: int) -> None:
    """Refuse, naming the layer, a QLoRA base weight that FSDP cannot split evenly over ``ranks``.

    FSDP cuts a weight into equal runs of rows, and an NF4 weight is cut the same way, codes,
    block scales and their groups alike, with no padding: each rank needs whole rows and whole
    groups of scales (``NF4_SCALER_BLOCK`` blocks of ``NF4_BLOCK`` weights, fewer in a small
    layer). The groups are not chosen to fit the world size: one process and every layout
    quantize alike, so that they train alike."""
    # Only a tensor subclass can be NF4: a run without one never imports torchao.
    subclassed = [(name, p) for name, p in model.named_parameters() if type(p) is not nn.Parameter]
    for name, param in subclassed:
        if not isinstance(param, _nf4()[0]):
            continue
        rows, groups = param.shape[0], param.n_blocks // param.scaler_block_size
        if rows % ranks or groups % ranks:
            raise ConfigError(
                [
                    f"lora.quantize_base: FSDP cannot split {name} {list(param.shape)} over {ranks} ranks: each "
                    f"needs whole rows and whole groups of NF4 scales, and it has {rows} rows and {groups} group(s) "
                    f"({param.n_blocks} blocks of {param.block_size} weights, {param.scaler_block_size} a group); "
                    "use parallel.strategy=ddp, fewer ranks, or leave the layer out of lora.target_modules"
                ]
            )


def _dequantized_state(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    # On the host one layer at a time: a save never holds the whole base dequantized on the device.
    key = prefix + "weight"
    weight = state.get(key)
    if weight is None:
        return
    local = local_part(weight)
    if not isinstance(local, _nf4()[0]):
        return
    plain = local.get_original_weight()
    if local is not weight:
        from torch.distributed.tensor import DTensor

        # This rank's rows (FSDP): DCP writes them beside the other ranks' as one plain tensor.
        plain = DTensor.from_local(
            plain, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride()
        )
    state[key] = plain.cpu()


def _load_quantized(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    key, current = prefix + "weight", cast(torch.Tensor, module.weight)
    quantized = local_part(current)
    if key not in state or not isinstance(quantized, _nf4()[0]):
        return
    saved = local_part(state[key]).to(quantized.device, quantized.dtype)
    # The same NF4 if ``saved`` is what it dequantizes to; else ``saved`` quantized (a shard: this
    # rank's rows alone) and written into the weight's own tensors, as NF4's copy_ would but for a
    # shard, whose block count it compares with the whole weight's. Loading then copies the
    # weight onto itself.
    if not torch.equal(saved, quantized.get_original_weight()):
        fresh = _nf4()[1](saved, quantized.block_size, quantized.scaler_block_size)
        with torch.no_grad():
            for name in quantized.__tensor_flatten__()[0]:
                getattr(quantized, name).copy_(getattr(fresh, name))
    state[key] = current


def _dequantized_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose QLoRA base weights are plain tensors again (dequantized, in
    the precision they were quantized from): what folding adapters into the base needs."""
    # Copying an NF4 tensor itself would quantize it anew (torchao's clone), blocks and all.
    memo = {
        id(p): nn.Parameter(p.get_original_weight(), requires_grad=False)
        for p in model.parameters()
        if hasattr(p, "get_original_weight")
    }
    return copy.deepcopy(model, memo)


def merge_lora(model: nn.Module, family: ModelFamily) -> nn.Module:
    """A copy of ``model`` (of ``family``) with every LoRA adapter folded into its layer's weight
    (a QLoRA base dequantized first) and the plain layer put back: the model its family's
    exporters know (``model`` itself if it has none)."""
    hf = family.transformers_model(model)
    if hf is not None and hasattr(hf, "merge_and_unload"):
        merged = _dequantized_copy(model)
        merged.hf = cast("PeftModel", merged.hf).merge_and_unload()  # hf is PEFT's wrapper: it merges
        return merged
    if not any(hasattr(module, "lora_A") for module in model.modules()):
        return model
    merged = _dequantized_copy(model)
    fold_lora(merged)
    return merged


def fold_lora(module: nn.Module) -> None:
    """Fold, in place, every LoRA adapter within ``module`` into its layer's weight and put the
    plain layer back (a head PEFT trained as a copy becomes that copy), as PEFT's
    ``merge_and_unload`` does for a whole model: the form in which a part of a model too large to
    copy is merged (``kiln export`` of a sharded run)."""
    adapted = [name for name, layer in module.named_modules() if hasattr(layer, "lora_A")]
    inside = tuple(f"{name}." for name in adapted)
    for name, layer in list(module.named_modules()):
        if name.startswith(inside):  # an adapter's own parts
            continue
        if hasattr(layer, "unload_and_optionally_merge_module"):  # PEFT's trained copy of a head
            plain = layer.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
        elif name in adapted:
            tuner = cast("BaseTunerLayer", layer)
            tuner.merge()
            plain = tuner.get_base_layer()
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, plain)
