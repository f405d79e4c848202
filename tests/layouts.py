"""The runs the parallel-layout tests compare: a tiny GPT trained for STEPS steps on a global
batch of GLOBAL sequences, in one process or laid out over gloo ranks by ``kiln launch``, and
what they are compared by. Every strategy must change speed, not results."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kiln.train.run import load_run

from conftest import tiny_overrides
from kilnrun import launch, losses, start

STEPS = 6
GLOBAL = 8
TRAIN_TIMEOUT_S = 10  # parallel.train_timeout of the watched runs (tests/distributed/test_watchdog.py)


def layout_sets(run_dir: Path, corpus: Path, micro: int, **extra) -> list[str]:
    """``--set`` arguments of the tiny run: ``micro`` sequences per micro-batch, a checkpoint every 3 steps."""
    base = dict(train__max_steps=STEPS, train__global_batch_size=GLOBAL, checkpoint__every=3, eval__sample_tokens=0)
    items = tiny_overrides(run_dir, corpus, **{**base, "train__micro_batch_size": micro, **extra})
    return [a for item in items for a in ("--set", item)]


def watched_sets(run_dir: Path, corpus: Path, **extra) -> list[str]:
    """Two DDP ranks' ``layout_sets`` (micro-batch 2) with the hang watchdog on."""
    return layout_sets(run_dir, corpus, micro=2, parallel__train_timeout=f"{TRAIN_TIMEOUT_S}s", **extra)


def train_on(nproc: int, sets: list[str], *launch_args: str, **kw) -> subprocess.CompletedProcess:
    """``kiln launch --nproc-per-node NPROC [LAUNCH_ARGS] -- train SETS``."""
    return launch(nproc, "train", *sets, launch_args=launch_args, **kw)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_run(run_dir, device="cpu").model.state_dict()


def assert_same_training(run_dir: Path, ref_dir: Path, steps=None, atol: float = 1e-4) -> None:
    got, want = losses(run_dir), losses(ref_dir)
    for step in steps or range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"loss at step {step}"
    # Reductions split over ranks sum in another order, so gradients differ by fp32 rounding, and
    # Adam's division by sqrt(v) magnifies that where a gradient is near zero. Each Adam step
    # moves a weight by up to lr = 1e-2; a real fault (a missing reduction, a wrong shard) shows
    # at that scale, 100x above this tolerance.
    for (name, a), b in zip(weights(run_dir).items(), weights(ref_dir).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=name)


def resumable_copy(run_dir: Path, to: Path, step: int) -> Path:
    """A copy of a finished run that looks as if it had stopped right after saving ``step``."""
    shutil.copytree(run_dir, to)
    for ckpt in (to / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return to


def workers(launcher_pid: int) -> list[int]:
    """The training processes torchrun started (its other helpers, if any, left out)."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "kiln" in line and " train" in line]


def started(args: list[str], run_dir: Path, steps: int, logged: int = 25) -> tuple[subprocess.Popen, list[int]]:
    """``kiln ARGS`` (a ``kiln launch`` of 2 workers) started and left to log ``logged`` of its
    ``steps`` steps; the launcher and its workers."""
    launcher = start(*args)
    deadline = time.time() + 120
    done: dict[int, float] = {}
    while time.time() < deadline:
        done = losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
        if max(done, default=0) >= logged:
            break
        time.sleep(0.05)
    found = workers(launcher.pid)
    assert len(found) == 2 and max(done, default=0) < steps, "the run ended before a worker could be killed"
    return launcher, found
