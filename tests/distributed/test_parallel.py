"""Scale-out through the real launcher: ``kiln launch`` (torchrun) with gloo processes on the CPU.

Every strategy must change speed, not results: losses and final weights are compared with one
process training on the same global batch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.train.run import load_run

from conftest import tiny_overrides
from kilnrun import kiln, launch, losses

STEPS = 6
GLOBAL = 8


def _sets(run_dir: Path, corpus: Path, micro: int, **extra) -> list[str]:
    items = tiny_overrides(
        run_dir,
        corpus,
        train__max_steps=STEPS,
        train__micro_batch_size=micro,
        train__global_batch_size=GLOBAL,
        checkpoint__every=3,
        eval__sample_tokens=0,
        **extra,
    )
    return [a for item in items for a in ("--set", item)]


def _launch(nproc: int, sets: list[str], *launch_args: str, **kw) -> subprocess.CompletedProcess:
    return launch(nproc, "train", *sets, launch_args=launch_args, **kw)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_run(run_dir, device="cpu").model.state_dict()


def _assert_same_training(run_dir: Path, ref_dir: Path, steps=None, atol: float = 1e-4) -> None:
    got, want = losses(run_dir), losses(ref_dir)
    for step in steps or range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"loss at step {step}"
    # Reductions split over ranks sum in another order, so gradients differ by fp32 rounding, and
    # Adam's division by sqrt(v) magnifies that where a gradient is near zero. Each Adam step
    # moves a weight by up to lr = 1e-2; a real fault (a missing reduction, a wrong shard) shows
    # at that scale, 100x above this tolerance.
    for (name, a), b in zip(_weights(run_dir).items(), _weights(ref_dir).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus_dir) -> Path:
    """One process, micro-batch 4, accumulation 2: the reference every strategy must match."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    kiln("train", *_sets(run_dir, corpus_dir, micro=4))
    return run_dir


def test_ddp_two_ranks_equal_one_process_with_twice_the_micro_batch(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "ddp"
    proc = _launch(2, _sets(run_dir, corpus_dir, micro=2))
    _assert_same_training(run_dir, single)
    # Only rank 0 prints progress.
    assert proc.stdout.count(f"step {STEPS}/{STEPS}") == 2  # the train line and the val line
    assert json.loads((run_dir / "env.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_a_sharded_checkpoint_exports_like_a_whole_one(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "fsdp"
    _launch(2, _sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp"))
    assert list((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state").glob("*.distcp"))
    ids = torch.randint(0, 512, (3, 32))
    for fmt in ("safetensors", "hf"):
        outputs = []
        for name, source in (("sharded", run_dir), ("whole", single)):
            out = tmp_path / f"{fmt}-{name}"
            kiln("export", str(source), "--format", fmt, "--out", str(out))
            info = json.loads((out / "export.json").read_text())
            assert info[fmt]["max_abs_diff"] <= 1e-5  # the artifact computes the gathered model
            outputs.append((sorted(info["files"]), load_run(out, device="cpu").model(ids).detach()))
        (sharded_files, sharded), (whole_files, whole) = outputs
        assert sharded_files == whole_files
        # The two runs trained alike (to Adam's amplified rounding, see _assert_same_training).
        torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-3)


@pytest.mark.parametrize(
    "strategy, micro, extra",
    [
        ("fsdp", 2, {}),
        ("fsdp_grad_op", 2, {}),
        ("ddp", 4, {"parallel__tp": 2}),  # tensor parallel over both ranks, data-parallel degree 1
    ],
)
def test_sharded_strategies_equal_one_process(tmp_path, corpus_dir, single, strategy, micro, extra):
    run_dir = tmp_path / "run"
    _launch(2, _sets(run_dir, corpus_dir, micro=micro, parallel__strategy=strategy, **extra))
    _assert_same_training(run_dir, single)
    # Sharded weights are saved with torch.distributed.checkpoint, one file per rank.
    state = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state"
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_out_of_memory_on_ranks_restarts_at_the_smaller_micro_batch(tmp_path, corpus_dir, single):
    """Ranks cannot retry a step alone (the others wait in collectives): the rung is saved in
    memory.json, the agent restarts the group, and the run resumes from its checkpoint there."""
    run_dir = tmp_path / "oom"
    # Out of memory above one sequence, after the checkpoint at step 3.
    faults = dict(debug__oom_above=1, debug__oom_from_step=4)
    proc = _launch(2, _sets(run_dir, corpus_dir, micro=2, **faults), "--max-restarts", "1", "--monitor-interval", "0.2")
    assert "out of memory at step 5 with micro-batch 2" in proc.stderr
    assert json.loads((run_dir / "memory.json").read_text())["micro_batch_size"] == 1
    assert "resumed from" in proc.stdout
    _assert_same_training(run_dir, single)


def test_fsdp_bf16_computes_in_bf16_and_keeps_fp32_weights(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "bf16"
    _launch(2, _sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp", train__precision="bf16"))
    got, want = losses(run_dir), losses(single)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=2e-2), f"loss at step {step}"
    assert got != want  # bf16 compute really happened: not bit-equal to the fp32 run
    # The master weights (and what the checkpoint holds) stay fp32.
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state")).read_metadata()
    dtypes = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes


def test_fsdp_times_tensor_parallel_on_four_ranks(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "2d"
    _launch(4, _sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp", parallel__tp=2), timeout=400)
    _assert_same_training(run_dir, single)


def _cut_after(run_dir: Path, step: int) -> None:
    """Make the run look as if it had stopped right after saving ``step``."""
    import shutil

    for ckpt in (run_dir / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)


@pytest.mark.parametrize("first, then", [("fsdp2", "single"), ("single", "fsdp2")])
def test_resume_with_another_world_size_and_strategy(tmp_path, corpus_dir, single, first, then):
    run_dir = tmp_path / "run"
    runs = {
        "fsdp2": lambda: _launch(2, _sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp")),
        "single": lambda: kiln("train", *_sets(run_dir, corpus_dir, micro=4)),
    }
    runs[first]()
    _cut_after(run_dir, 3)
    proc = runs[then]()
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    _assert_same_training(run_dir, single, steps=range(4, STEPS + 1))


def test_rank_errors_name_the_rank(tmp_path, corpus_dir):
    sets = _sets(tmp_path / "run", corpus_dir, micro=8)  # global 8 is not a multiple of 8 x 2 ranks
    proc = _launch(2, sets, check=False)
    assert proc.returncode != 0
    assert "kiln [rank 1]: config error: train.micro_batch_size: 8 does not divide" in proc.stderr
    assert "train.global_batch_size (8 / 2 = 4)" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_at_a_c10d_rendezvous(tmp_path, corpus_dir, single):
    run_dir = tmp_path / "nodes"
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kiln",
        "launch",
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "kiln-test",
        "--",
        "train",
        *_sets(run_dir, corpus_dir, micro=2),
    ]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outs]
    _assert_same_training(run_dir, single)


def _workers(launcher_pid: int) -> list[int]:
    """The training processes torchrun started (its other helpers, if any, left out)."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "kiln" in line and " train" in line]


def _started(cmd: list[str], run_dir: Path, steps: int) -> tuple[subprocess.Popen, list[int]]:
    """``cmd`` (a ``kiln launch`` of 2 workers) started and left to log 25 of its ``steps``
    steps; the launcher and its workers."""
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    done: dict[int, float] = {}
    while time.time() < deadline:
        done = losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
        if max(done, default=0) >= 25:
            break
        time.sleep(0.05)
    workers = _workers(launcher.pid)
    assert len(workers) == 2 and max(done, default=0) < steps, "the run ended before a worker could be killed"
    return launcher, workers


def test_elastic_restart_after_a_worker_is_killed(tmp_path, corpus_dir):
    steps = 300
    extra = dict(train__max_steps=steps, checkpoint__every=10, train__log_every=1)

    def sets(run_dir):
        items = tiny_overrides(
            run_dir,
            corpus_dir,
            train__micro_batch_size=2,
            train__global_batch_size=GLOBAL,
            eval__sample_tokens=0,
            **extra,
        )
        return [a for item in items for a in ("--set", item)]

    ref = tmp_path / "uninterrupted"
    _launch(2, sets(ref))
    run_dir = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "kiln",
        "launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        "--",
        "train",
        *sets(run_dir),
    ]
    launcher, workers = _started(cmd, run_dir, steps)
    os.kill(workers[1], signal.SIGKILL)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-4000:]
    assert "resumed from" in out
    for (name, a), b in zip(_weights(run_dir).items(), _weights(ref).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_on_every_visible_gpu(tmp_path, corpus_dir, strategy):
    """DDP and FSDP over NCCL, one rank per GPU, against one process on one GPU."""
    n = torch.cuda.device_count()
    global_batch = 8 * n
    common = dict(
        train__global_batch_size=global_batch,
        eval__sample_tokens=0,
        run__device="cuda",
        checkpoint__every=3,
        train__max_steps=STEPS,
    )
    ref = tmp_path / "one"
    kiln(
        "train",
        *[a for i in tiny_overrides(ref, corpus_dir, train__micro_batch_size=8 * n, **common) for a in ("--set", i)],
    )
    run_dir = tmp_path / "all"
    _launch(
        n,
        [
            a
            for i in tiny_overrides(
                run_dir, corpus_dir, train__micro_batch_size=8, parallel__strategy=strategy, **common
            )
            for a in ("--set", i)
        ],
    )
    got, want = losses(run_dir), losses(ref)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-3)


def test_time_planned_run_agrees_over_ranks(tmp_path, corpus_dir):
    """max_steps=auto on 2 ranks: they probe the same number of steps (a rank stopping on its own
    clock would leave the other in a collective), plan the same run from the slowest costs, and
    correct it alike from the slowest pace and clock."""
    run = tmp_path / "ddp"
    items = tiny_overrides(
        run, corpus_dir, train__max_steps="auto", train__time_budget="8s", eval__sample_tokens=0, checkpoint__every=0
    )
    _launch(2, [a for item in items for a in ("--set", item)])
    planned = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [plan] = [r for r in planned if r.get("event") == "time_plan"]
    final = [r for r in planned if r.get("event") in ("time_plan", "time_replan")][-1]["max_steps"]
    config = (run / "config.toml").read_text()
    assert f"max_steps = {final}" in config and plan["max_steps"] > STEPS
    # Both ranks then trained in step (the run ends at its plan, or on the budget's hard stop).
    assert STEPS < max(losses(run)) <= final
