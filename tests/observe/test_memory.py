"""Memory telemetry reads the process's real resident memory."""

import torch

from kiln.observe.memory import GIB, memory_stats, process_rss_bytes


def test_rss_grows_with_a_large_tensor():
    before = process_rss_bytes()
    big = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched by ones()
    after = process_rss_bytes()
    assert after - before > 200 * 2**20
    del big


def test_cpu_stats_have_rss_only():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"memory/rss_gib"}
    assert 0.05 < stats["memory/rss_gib"] < process_rss_bytes() / GIB + 1
