"""The device a run computes on, and what it can do: which device and precision "auto" mean, and
the peak throughput of known accelerators (the denominator of model FLOPs utilisation, MFU)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from kiln.config import Config, ConfigError

# Dense (no sparsity) bf16 tensor-core peak per device, in FLOP/s, from the vendors' datasheets.
# Matched as substrings of torch.cuda.get_device_name(), longest first ("H100 PCIe" before "H100").
PEAK_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
}
# Each PEAK_FLOPS entry's memory by its datasheet, what ``kiln plan --gpu NAME`` plans for unless
# --device-memory says otherwise (the A100 and the B200 also come with other sizes).
DATASHEET_MEMORY: dict[str, int] = {
    "H100 PCIe": 80 * 2**30,
    "H100 NVL": 94 * 2**30,
    "H100": 80 * 2**30,
    "H200": 141 * 10**9,
    "B200": 180 * 10**9,
    "A100": 80 * 2**30,
}


def resolve_device(name: str) -> torch.device:
    """``run.device``: auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            [f"run.device: {name!r} requested but CUDA is not available on this machine; use cpu or auto"]
        )
    return device


def auto_precision(device: torch.device) -> Literal["bf16", "fp32"]:
    """What ``train.precision = "auto"`` is on ``device``: bf16 on a CUDA device that computes it
    natively (compute capability 8.0 and newer: A100, H100, ...), fp32 elsewhere (CPUs, where
    bf16 autocast is slower than fp32 without AMX, and older GPUs)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "bf16"
    return "fp32"


def resolve_precision(cfg: Config, device: torch.device) -> Config:
    """``cfg`` with ``train.precision = "auto"`` replaced by what it is on ``device``."""
    if cfg.train.precision != "auto":
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=auto_precision(device)))


def gpu_key(name: str) -> str | None:
    """The PEAK_FLOPS entry a GPU name ("NVIDIA H100 80GB HBM3", "h100") falls under: the longest
    key it contains, case aside; None for a GPU not in the table."""
    lowered = name.strip().lower()
    return next((key for key in sorted(PEAK_FLOPS, key=len, reverse=True) if key.lower() in lowered), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None on CPU and on accelerators not in PEAK_FLOPS."""
    if device.type != "cuda":
        return None
    key = gpu_key(torch.cuda.get_device_name(device))
    return PEAK_FLOPS[key] if key else None


# glibc's mallopt parameter number of the size from which allocations get their own mapping.
_M_MMAP_THRESHOLD = -3


def return_freed_host_memory() -> bool:
    """Make the host allocator give large freed blocks back to the system at once.

    PyTorch allocates CPU tensors with the C library's malloc. glibc raises its threshold for
    giving an allocation its own mapping each time such a block is freed (up to 32 MB), after
    which blocks of a layer's size come from its heap and stay in the process when freed: a rank
    that gathers one sharded layer after another then holds gigabytes it no longer uses, and its
    resident memory, what a machine's limit counts, grows far above its live tensors. A fixed
    threshold of 1 MB keeps every large tensor in its own mapping, returned when freed; the price
    is fresh pages for each such allocation, which a CPU loop that allocates large activations
    every step pays in speed. Returns whether the C library took the setting (only glibc has it;
    elsewhere nothing changes)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20))
    except (OSError, AttributeError):
        return False
