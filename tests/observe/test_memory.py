"""Memory telemetry reads the process's real resident memory."""

import torch

from kiln.observe.memory import GIB, memory_stats, process_rss_bytes


def test_rss_grows_with_a_large_tensor():
    big = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched by ones(), in a mapping of its own
    held = process_rss_bytes()
    del big  # the mapping is returned at once
    # Measured as it falls, not as it rises: a machine that reclaims idle pages in the background
    # may take some of the process's others between two readings, which only deepens the fall.
    assert held - process_rss_bytes() > 200 * 2**20


def test_cpu_stats_have_rss_only():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"memory/rss_gib"}
    assert 0.05 < stats["memory/rss_gib"] < process_rss_bytes() / GIB + 1
