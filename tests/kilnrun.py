"""Running kiln as a user does, for every test that needs it: the ``kiln`` command in a
subprocess, ``kiln launch`` over gloo ranks on the CPU, and reading what a run wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

TESTS = Path(__file__).parent
EXAMPLES = TESTS.parent / "examples"


def command(*args: Any) -> list[str]:
    """The command line of ``kiln ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "kiln", *map(str, args)]


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, ``env`` on top, with tests/ and examples/ on the path (plug-in
    families, helpers and the example reward functions the runs import live there)."""
    path = os.pathsep.join(filter(None, [str(TESTS), str(EXAMPLES), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(env or {})}


def kiln(*args: Any, env: dict[str, str] | None = None, check: bool = True, timeout: float = 300, **kw: Any):
    """Run ``kiln ARGS...`` to the end; with ``check``, fail the test (with the output's tail)
    unless it exits 0."""
    proc = subprocess.run(command(*args), capture_output=True, text=True, env=environment(env), timeout=timeout, **kw)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        raise AssertionError(f"kiln {' '.join(map(str, args))} exited {proc.returncode}\n{output}")
    return proc


def in_process(*args: Any, check: bool = True) -> subprocess.CompletedProcess:
    """``kiln ARGS...`` run by ``kiln.cli.main`` in this process, its output captured: the same
    code path as the command, without an interpreter's start (importing torch takes seconds).
    For single-process work whose subject is not the process itself (exit on a signal, say)."""
    import contextlib
    import io

    from kiln.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(map(str, args)))
    proc = subprocess.CompletedProcess(command(*args), code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"kiln {' '.join(map(str, args))} returned {code}\n{proc.stdout[-3000:]}\n{proc.stderr}")
    return proc


def launch(
    nproc: int,
    *args: Any,
    launch_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``kiln launch --nproc-per-node NPROC [LAUNCH_ARGS] -- ARGS...`` (torchrun, gloo ranks) run
    to the end; with ``check``, fail the test unless it exits 0.

    The launcher is ``kiln.cli.main`` in this process: torchrun's agent runs here and starts the
    ranks as the command does, as processes of this interpreter with this environment (``env``
    on top), without the launcher's own interpreter start (importing torch and kiln: seconds a
    launch). What the ranks and the agent print is read from this process's file descriptors;
    the environment and the signal handlers torchrun sets are put back afterwards. Past
    ``timeout`` seconds the ranks are killed and the test fails. (Tests that signal the
    launcher's process start it with ``start``.)"""
    import contextlib
    import signal
    import tempfile
    import threading

    from kiln.cli import main

    argv = ["launch", "--nproc-per-node", str(nproc), *map(str, launch_args), "--", *map(str, args)]
    saved_env = dict(os.environ)
    handled = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    saved_handlers = {sig: signal.getsignal(sig) for sig in handled}
    expired = threading.Event()

    def kill_ranks() -> None:
        expired.set()
        for pid in _children("kiln"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill_ranks)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.environ.update(environment(env))
        timer.start()
        try:
            with (
                open(1, "w", closefd=False) as py_out,
                open(2, "w", closefd=False) as py_err,
                contextlib.redirect_stdout(py_out),
                contextlib.redirect_stderr(py_err),
            ):
                code = main(argv)
        finally:
            timer.cancel()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.environ.clear()
            os.environ.update(saved_env)
            for sig, handler in saved_handlers.items():
                signal.signal(sig, handler)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(
            command(*argv), code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
        )
    if expired.is_set():
        raise AssertionError(
            f"kiln {' '.join(argv)} ran past {timeout} s\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        )
    if check and code != 0:
        raise AssertionError(f"kiln {' '.join(argv)} exited {code}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    return proc


def _children(word: str) -> list[int]:
    """The processes this one started whose command line holds ``word``."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if word in line]


def start(*args: Any, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
    """``kiln ARGS...`` started in the background, its output piped."""
    return subprocess.Popen(
        command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(env), **kw
    )


def sets(items: list[str]) -> list[str]:
    """``--set ITEM`` for each item."""
    return [arg for item in items for arg in ("--set", str(item))]


def records(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """The logged training loss of each step."""
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's weights and the rest of its state, without its wall-clock figures (the
    meter's seconds into the interval): what two runs that computed the same must agree on."""
    from kiln.checkpoint import load_checkpoint

    weights, state = load_checkpoint(path, weights_only=False)
    state["meter"]["interval"].pop("seconds")
    return weights, state


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """Two checkpoint payloads hold equal values, tensors bitwise; ``where`` names the entry."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def kill_and_resume(tmp_path: Path, items: list[str], kill_after: int) -> None:
    """A run of ``items`` (``KEY=VALUE``, train.max_steps among them) killed with SIGKILL once
    it has logged step ``kill_after``, then resumed, ends with the losses and the weights of the
    same run left alone, bit for bit."""
    full = tmp_path / "full"
    in_process("train", *sets(items), "--set", f"run.dir={full}")
    killed = tmp_path / "killed"
    proc = start("train", *sets(items), "--set", f"run.dir={killed}")
    deadline, seen = time.time() + 120, []
    while time.time() < deadline:
        seen = list(losses(killed)) if (killed / "metrics.jsonl").exists() else []
        if seen and seen[-1] >= kill_after:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps = int(next(s.split("=")[1] for s in items if s.startswith("train.max_steps=")))
    assert seen and seen[-1] < steps, "the run finished before it could be killed"
    in_process("train", *sets(items), "--set", f"run.dir={killed}")
    assert losses(killed) == losses(full)
    from kiln.train.run import load_run

    a, b = load_run(full, device="cpu").model.state_dict(), load_run(killed, device="cpu").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
