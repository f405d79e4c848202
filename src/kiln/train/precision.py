"""Numeric precision as one object the loop asks for a context and a step, whatever the mode."""

from __future__ import annotations

import contextlib
from typing import Protocol, cast

import torch
from torch import nn

from kiln.compat import quiet_library_imports
from kiln.config import ConfigError
from kiln.distributed.parallel import local_part

# The dtype autocast computes in; fp8's float8 matrix products live inside its linear layers.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def autocast(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """What the loss is computed in under train.precision ``mode`` on ``device``."""
    if mode == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[mode])


class LossScale:
    """fp16's dynamic loss scale (GradScaler's rule: from 2^16, halved after a step whose
    gradients overflow, which is skipped, doubled after 2000 finite steps in a row), decided from
    the step's global gradient norm, so that every rank takes the same decision and keeps the same
    scale whatever the layout: a shard's or a pipeline stage's own gradients say nothing of the
    others' (GradScaler decides per rank), and a pipeline's stages all unscale gradients that
    carry the last stage's scale. Kept on the device: no host sync. Disabled, it is the identity."""

    GROWTH_INTERVAL = 2000

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.scale = torch.full((), 2.0**16 if enabled else 1.0, device=device)
        self.finite_steps = torch.zeros((), dtype=torch.int64, device=device)  # since the last change
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.enabled:
            return
        inverse = self.scale.double().reciprocal().float()
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    local = local_part(param.grad)
                    local.mul_(inverse.to(local.dtype))

    def update(self, finite: torch.Tensor) -> None:
        """After the step: ``finite``, whether the step's global gradient norm was."""
        if not self.enabled:
            return
        grown = finite & (self.finite_steps + 1 >= self.GROWTH_INTERVAL)
        self.scale = torch.where(finite, torch.where(grown, self.scale * 2, self.scale), self.scale * 0.5)
        self.finite_steps = torch.where(finite & ~grown, self.finite_steps + 1, 0)
        self.skipped += (~finite).long()

    def state_dict(self) -> dict:
        return {"scale": self.scale.item(), "finite_steps": int(self.finite_steps), "skipped": int(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(state["scale"])
        self.finite_steps.fill_(state["finite_steps"])
        self.skipped.fill_(state["skipped"])


class Precision:
    """fp32: plain. bf16: autocast (same exponent range as fp32, so no loss scaling).
    fp16: autocast plus a dynamic loss scale (``LossScale``), whose skipped steps (inf/NaN
    gradients) are counted.
    fp8: bf16 autocast, with the model's linear layers made float8 ones by ``convert``.

    A disabled loss scale is the identity, so the loop calls the same methods in every mode
    instead of branching on it."""

    def __init__(self, mode: str, device: torch.device, fp8_recipe: str = "tensorwise"):
        self.mode = mode
        self.device = device
        self.fp8_recipe = fp8_recipe
        self.float8: list[str] = []  # the layers ``convert`` made float8
        self.dtype = DTYPES[mode]
        self.loss_scale = LossScale(device, enabled=mode == "fp16")

    def convert(self, model: nn.Module) -> None:
        """Make ``model`` this precision's, in place, before it is sharded or compiled (and, when
        built on ``meta``, before any rank allocates it): every run's one place for it, whatever
        the layout. In every mode but fp32 its frozen parameters are stored in the compute dtype
        (``store_frozen``); under fp8 its linear layers become torchao's float8 training layers
        (their names: ``float8``).

        The weights stay what they were (a float8 layer is an ``nn.Linear`` whose forward casts
        its input and weight to float8 with dynamic scales), so checkpoints, exports and resumes
        are those of the plain model. Left in bf16, as torchtitan leaves them: the output layer
        (the model's last linear layer, which feeds the loss and is the most sensitive to
        rounding), a layer sharing its weight with an embedding, and a layer with a side not a
        multiple of 16, which float8 matrix products cannot take."""
        if self.mode != "fp32":
            store_frozen(model, self.dtype)
        if self.mode != "fp8":
            return
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            name = torch.cuda.get_device_name(self.device)
            raise ConfigError(
                [
                    f"train.precision: fp8 needs a GPU of compute capability 8.9 or newer (H100, L4, RTX 4090); {name} "
                    "is not; use bf16"
                ]
            )
        quiet_library_imports()
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            raise ConfigError(["train.precision: fp8 needs torchao: pip install torchao"]) from None
        tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        output = linears[-1] if linears else None

        def eligible(module: nn.Module, name: str) -> bool:
            return (
                isinstance(module, nn.Linear)
                and name != output
                and id(module.weight) not in tables
                and module.in_features % 16 == 0
                and module.out_features % 16 == 0
            )

        self.float8 = [name for name, m in model.named_modules() if eligible(m, name)]
        config = Float8LinearConfig.from_recipe_name(self.fp8_recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=eligible)

    def describe(self) -> list[str]:
        """Lines for the console about what the precision did to the model."""
        if not self.float8:
            return []
        return [f"fp8: {len(self.float8)} linear layers multiply in float8 ({self.fp8_recipe} scales)"]

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.mode, self.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.loss_scale.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
        """Apply the update unless ``finite`` (a 0-d bool tensor on the device: whether the step's
        global gradient norm is) is false; then fp16's loss scale follows it.

        The fused AdamW kernel takes the flag on the device, as it does from GradScaler, and
        leaves parameters and optimizer state (step count included) untouched when it is set:
        no host sync. Other optimizers make the host read the flag first."""
        if optimizer.defaults.get("fused") or getattr(optimizer, "skips_on_device", False):
            step_unless(optimizer, found_inf=(~finite).float())
        elif finite.item():
            optimizer.step()
        self.loss_scale.update(finite)

    def metrics(self) -> dict[str, float]:
        """What the logged record says of the precision: fp16's skipped steps and loss scale."""
        if not self.loss_scale.enabled:
            return {}
        return {"skipped_steps": int(self.loss_scale.skipped), "loss_scale": self.loss_scale.scale.item()}

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale.state_dict()} if self.loss_scale.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        if state.get("loss_scale"):
            self.loss_scale.load_state_dict(state["loss_scale"])
        elif state.get("scaler"):  # a checkpoint of GradScaler's days
            old = state["scaler"]
            self.loss_scale.load_state_dict(
                {"scale": old["scale"], "finite_steps": old["_growth_tracker"], "skipped": state["skipped_steps"]}
            )


def store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every frozen floating-point parameter of ``model`` (a LoRA run's base) in ``dtype``,
    in place; trainable ones stay fp32, the optimizer's master weights.

    No optimizer step ever updates a frozen weight, so an fp32 copy of it holds nothing that the
    compute dtype loses in the forward: half the bytes, on every rank (sharded or not). On a model
    built on ``meta`` only the dtype changes, and each rank then writes its shards' values in it
    (``Values.fill`` copies into the allocated tensor), so no rank ever holds the fp32 base.

    1-D norm weights and biases are stored in ``dtype`` too, though they are few bytes: FSDP's
    bf16 compute casts every parameter to bf16 for the forward, so one process computes what the
    sharded layouts compute only if it stores them so (``transformers``' RMSNorms compute their
    statistics in fp32 whatever the weight's dtype). A tensor subclass (QLoRA's NF4 weight) keeps
    its own format, which dequantizes to the input's dtype in the forward."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and type(param) is nn.Parameter:
            # ``.data`` keeps the Parameter object, so a weight held under two names stays tied.
            param.data = param.data.to(dtype)


class _AmpScaled(Protocol):
    """What GradScaler sets on an optimizer whose step reads it (``_step_supports_amp_scaling``)."""

    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()``, skipped on the device where ``found_inf`` (a 0-d float tensor) is 1.

    PyTorch's fused optimizers read the flag from the ``grad_scale`` and ``found_inf`` attributes
    that GradScaler sets on them (the private protocol of ``_step_supports_amp_scaling``); there
    is no public argument for it. ``tests/train/test_guard.py`` (the device-side skip) fails if the fused
    kernel stops reading them."""
    scaled = cast(_AmpScaled, optimizer)
    scaled.grad_scale, scaled.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del scaled.grad_scale, scaled.found_inf
