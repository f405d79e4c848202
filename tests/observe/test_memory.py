"""Memory telemetry reads the process's real resident memory."""

import subprocess
import sys

import torch

from kiln.observe.memory import GIB, memory_stats, process_rss_bytes


def test_rss_grows_with_a_large_tensor():
    """In a fresh interpreter: in the suite's long-lived process, whose allocator has served and
    kept memory for hundreds of tests, a new tensor may reuse pages already counted (a 256 MiB
    tensor read as a 173 MiB rise, then as none, in CI)."""
    script = (
        "import torch; from kiln.observe.memory import process_rss_bytes as rss; "
        "before = rss(); big = torch.ones(256 * 2**20 // 4); print(rss() - before)"
    )
    grown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert int(grown.stdout.split()[-1]) > 200 * 2**20


def test_cpu_stats_have_rss_only():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"memory/rss_gib"}
    assert 0.05 < stats["memory/rss_gib"] < process_rss_bytes() / GIB + 1
