"""The hang watchdog and straggler detection, through the real launcher with gloo processes on the
CPU: a rank made to stop is named, every rank dumps its stacks, the job exits and restarts from
its checkpoint to the weights of an uninterrupted run; a slowed rank is named a straggler; and
``kill -USR1`` writes a rank's stacks. The culprit logic is also checked on accounts alone."""

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

from kiln.distributed.watchdog import HANG_EXIT, collective_env, describe

from kilnrun import losses, start
from layouts import TRAIN_TIMEOUT_S as TIMEOUT_S
from layouts import watched_sets as _watched
from layouts import weights, workers


def _start(sets: list[str], *launch_args: str) -> subprocess.Popen:
    return start("launch", "--nproc-per-node", "2", "--monitor-interval", "0.2", *launch_args, "--", "train", *sets)


def _wait_for(condition, timeout: float, what: str) -> float:
    """Poll until ``condition()`` holds; the time it did."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return time.time()
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _logged_step(run_dir: Path) -> int:
    return max(losses(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0


@pytest.mark.slow
def test_a_hung_rank_is_named_dumped_and_the_job_restarts_from_its_checkpoint(tmp_path, corpus_dir, ddp_run):
    ref = ddp_run[0]  # the same watched run, uninterrupted
    assert not list((ref / "hang").glob("2*"))  # the watchdog raised no false alarm there
    run_dir = tmp_path / "hung"
    # Rank 1 hangs before step 5, after the checkpoint at step 3; a restarted group runs on.
    launcher = _start(_watched(run_dir, corpus_dir, debug__hang_rank=1, debug__hang_step=5), "--max-restarts", "1")
    # Rank 1 stops once step 4 is done; rank 0 then waits for it in the gradient all-reduce.
    stopped = _wait_for(lambda: _logged_step(run_dir) >= 4, 120, "step 4")
    reported = _wait_for(lambda: list(run_dir.glob("hang/*/summary.json")), TIMEOUT_S + 60, "the hang report")
    assert reported - stopped < TIMEOUT_S + 30
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-4000:]

    [hang] = [p.parent for p in run_dir.glob("hang/*/summary.json")]
    summary = json.loads((hang / "summary.json").read_text())
    assert summary["culprits"] == [1] and summary["missing"] == []
    assert summary["evidence"] == "flight recorder"
    said = f"kiln: rank 1 on {socket.gethostname()} did not arrive at gloo:all_reduce #"
    assert said in (hang / "summary.txt").read_text() and said in err
    assert "which rank 0 waits in" in err
    for rank in (0, 1):
        stacks = (hang / f"rank-{rank}.txt").read_text()
        assert "most recent call first" in stacks and "in fit" in stacks, stacks
        account = json.loads((hang / f"rank-{rank}.json").read_text())
        assert account["rank"] == rank and account["step"] == 4
        assert json.loads((hang / f"flight-recorder-rank-{rank}.json").read_text())["cpu"]["entries"]
    assert "in before_forward" in (hang / "rank-1.txt").read_text()  # where the fault holds it
    # Every rank exited with the watchdog's status, and the agent restarted them.
    assert f"exitcode: {HANG_EXIT}" in err or f"exitcode={HANG_EXIT}" in err, err[-4000:]
    assert "resumed from" in out
    for (name, a), b in zip(weights(run_dir).items(), weights(ref).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.wallclock
@pytest.mark.slow
def test_a_slowed_rank_is_named_a_straggler_and_usr1_dumps_a_ranks_stacks(tmp_path, corpus_dir):
    run_dir = tmp_path / "slow"
    # Each forward pass of rank 1 takes 0.25 s longer; a step has two.
    launcher = _start(_watched(run_dir, corpus_dir, debug__slow_rank=1, debug__slow_seconds=0.25))
    _wait_for(lambda: _logged_step(run_dir) >= 2, 120, "step 2")
    ranks = workers(launcher.pid)
    assert len(ranks) == 2
    for pid in ranks:
        os.kill(pid, signal.SIGUSR1)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-4000:]  # the signal dumped the stacks, and training went on

    for rank in (0, 1):
        stacks = (run_dir / "hang" / f"stacks-rank-{rank}.txt").read_text()
        assert "most recent call first" in stacks and "in fit" in stacks, stacks
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "straggler"]
    # Named once, after observe.straggler_intervals (3) slow log intervals (one step each) in a row.
    # (DDP's first forward of its second step waits for the other rank while it rebuilds its
    # buckets, so rank 0 may look as slow at step 2, and the count starts again.)
    assert [(e["rank"], e["host"]) for e in events] == [(1, socket.gethostname())]
    assert 3 <= events[0]["step"] <= 6
    assert events[0]["step_s"] > 1.5 * events[0]["median_s"]
    assert f"rank 1 on {socket.gethostname()} is a straggler" in out


# -- who held the others up, from the ranks' accounts alone --------------------------------------


def _account(rank: int, beats: int = 20, **last: int) -> dict:
    """A rank's account: its last collective's number in each group (``dp=7``)."""
    return {
        "rank": rank,
        "host": "node",
        "pid": 100 + rank,
        "step": 4,
        "phase": "forward/backward (gradient reduction)",
        "quiet_s": 10.0,
        "beats": beats,
        "where": ["kiln/train/trainer.py:230 in fit"],
        "collectives": {
            g: {"seq": n, "op": "nccl:all_reduce", "group": f"mesh_{g}", "sizes": [[8]]} for g, n in last.items()
        },
    }


def test_the_rank_behind_in_collectives_and_ahead_in_none_did_not_arrive():
    # Rank 3 stopped; rank 2, its tensor-parallel peer, waits in their all-reduce (so it is behind
    # rank 0 and 1 in the data-parallel group, but ahead in its own); ranks 0 and 1 wait in dp.
    accounts = {
        0: _account(0, dp=8, tp01=5),
        1: _account(1, dp=8, tp01=5),
        2: _account(2, dp=7, tp23=5),
        3: _account(3, dp=7, tp23=4),
    }
    summary = describe(accounts, 4)
    assert summary["culprits"] == [3]
    assert (
        "rank 3 on node did not arrive at nccl:all_reduce #8 of mesh_dp, which ranks 0, 1 wait in; "
        "nccl:all_reduce #5 of mesh_tp23, which rank 2 waits in"
    ) in summary["text"]


def test_without_flight_records_the_loop_progress_names_the_rank_behind():
    summary = describe({0: _account(0, beats=21), 1: _account(1, beats=20)}, 2)
    assert summary["culprits"] == [1] and summary["evidence"] == "loop progress"
    assert "rank 1 on node is behind the others" in summary["text"]


def test_ranks_that_send_no_report_are_named_and_even_ranks_blame_no_one():
    summary = describe({0: _account(0, dp=3)}, 2)
    assert summary["culprits"] == [] and summary["missing"] == [1]
    assert "rank 1 sent no report" in summary["text"]
    even = describe({0: _account(0, dp=3), 1: _account(1, dp=3)}, 2)
    assert even["culprits"] == [] and "no rank is behind" in even["text"]


def test_a_users_nccl_settings_win_under_either_name(monkeypatch, tmp_path):
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the older name of TORCH_FR_BUFFER_SIZE
    assert collective_env(tmp_path, nccl=True) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "hang" / "nccl-trace-rank-"),
    }
    assert "TORCH_FR_DUMP_TEMP_FILE" not in collective_env(tmp_path, nccl=False)  # gloo has no dump of its own


@pytest.mark.gpu
def test_nccl_ranks_run_with_the_hang_settings_and_dump_their_flight_recorder(tmp_path, corpus_dir):
    """Two NCCL ranks (one GPU each): the settings are in force in each rank, NCCL's flight recorder
    is dumped, and the summary names the stopped rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL runs one rank per GPU")
    run_dir = tmp_path / "hung"
    launcher = _start(_watched(run_dir, corpus_dir, run__device="cuda", debug__hang_rank=1, debug__hang_step=5))
    stopped = _wait_for(lambda: _logged_step(run_dir) >= 4, 180, "step 4")
    out, err = launcher.communicate(timeout=TIMEOUT_S + 120)
    assert launcher.returncode == HANG_EXIT, err[-4000:]
    assert time.time() - stopped < TIMEOUT_S + 30
    [hang] = [p.parent for p in run_dir.glob("hang/*/summary.json")]
    assert json.loads((hang / "summary.json").read_text())["culprits"] == [1]
    for rank in (0, 1):
        env = json.loads((hang / f"rank-{rank}.json").read_text())["env"]
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(run_dir / "hang" / "nccl-trace-rank-")
        records = json.loads((hang / f"flight-recorder-rank-{rank}.json").read_text())
        assert any(e["profiling_name"].startswith("nccl:") for e in records["nccl"]["entries"])


# A rank of two whose partner never reports: the watchdog declares a hang. Its loop then fails as
# a collective would once a peer that exited for the hang broke the connection.
_BROKEN_LOOP = """
import sys, time
from pathlib import Path
import torch.distributed as dist
from kiln.distributed.watchdog import Watchdog

run_dir = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{run_dir}/store", rank=0, world_size=1)
watchdog = Watchdog(rank=0, size=2, init_timeout_s=0.5, train_timeout_s=0.5)
with watchdog.watching(run_dir):
    while not list(run_dir.glob("hang/2*/rank-0.txt")):
        time.sleep(0.05)
    raise RuntimeError("Connection closed by peer")
"""


@pytest.mark.wallclock
def test_a_loop_that_fails_while_its_rank_reports_a_hang_still_ends_with_the_hang_status(tmp_path):
    """The peer's exit must not turn this rank's report into a crash: the agent restarts on
    HANG_EXIT, and the summary is written before the process ends."""
    done = subprocess.run(
        [sys.executable, "-c", _BROKEN_LOOP, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == HANG_EXIT, done.stderr[-4000:]
    [summary] = tmp_path.glob("hang/2*/summary.json")
    assert json.loads(summary.read_text())["missing"] == [1]
    assert "rank 1 sent no report" in done.stderr


def test_the_private_torch_functions_the_watchdog_relies_on_are_there():
    """torch has no public way to reach the default group's store (where the ranks' reports
    meet), to change a live group's timeout, or to read the flight recorder in-process; the
    watchdog uses these private functions, each in one place. A new torch that drops or renames
    one fails here, by name, before a hang goes unreported."""
    from torch.distributed import distributed_c10d

    assert callable(getattr(distributed_c10d, "_get_default_store", None)), "_get_default_store"
    assert callable(getattr(distributed_c10d, "_set_pg_timeout", None)), "_set_pg_timeout"
    assert callable(getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)), "_dump_fr_trace_json"
