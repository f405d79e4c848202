"""Memory telemetry for the logs: device peaks since the last log point, and the process's RSS.

Reading the CUDA caching allocator's counters is a host-side query (no device sync), so this is
cheap enough for every log interval.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

GIB = 2**30


def process_rss_bytes() -> int:
    """Resident memory of this process now (Linux), or its peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def memory_stats(device: torch.device) -> dict[str, float]:
    """``memory/rss_gib`` always; on CUDA also the peak allocated and reserved memory since the
    previous call (the peaks are reset, so each log interval reports its own)."""
    stats = {"memory/rss_gib": process_rss_bytes() / GIB}
    if device.type == "cuda":
        stats["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        stats["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    return stats
