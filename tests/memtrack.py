"""Measure the peak tensor memory of a piece of work, on a GPU or on the CPU.

On CUDA the caching allocator keeps the count: ``torch.cuda.max_memory_allocated``. The CPU
allocator keeps none, so there every tensor storage created while the work runs is recorded
(from the outputs of each operator, seen through a ``TorchDispatchMode``) and dropped from the
count when Python frees it; storages shared by views and in-place results count once. That is
live tensor memory, the same quantity the CUDA counter reports, less what kernels allocate
privately for themselves (small scratch buffers).

On the CPU the work runs on fake tensors (PyTorch's ``FakeTensorMode``): every operator runs for
the shape, dtype and storage of its output, without computing a value, so the same storages live
and die as in the real work, in a fraction of its time (a gpt2-124m step in bf16 takes minutes
on 2 cores). Work that reads values on the host (``.item()``) cannot be measured this way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        known = self.sizes.get(key)
        if known is None:
            weakref.finalize(storage, self._freed, key)
        # An operator with an out= argument may have resized a storage it was given.
        self.live += nbytes - (known or 0)
        self.sizes[key] = nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._record(leaf)
        self.peak = max(self.peak, self.live)
        return out


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The most bytes of tensor memory that ``fn()`` had allocated at once, beyond what was
    allocated when it started.

    Tensors that exist before the call (a model built outside it, say) are not part of the
    figure; build them inside ``fn`` to include them, or add their bytes. On CUDA this is
    ``max_memory_allocated`` during the call less ``memory_allocated`` before it; elsewhere the
    storages are tracked as the module docstring describes.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Tensors made before the call (real ones) become fake where the work uses them.
    with FakeTensorMode(allow_non_fake_inputs=True), _LiveStorages() as tracker:
        fn()
    return tracker.peak
