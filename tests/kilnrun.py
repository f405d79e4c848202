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


# The ranks of an in-process launch are forked from one server process that has imported torch,
# TorchDynamo and kiln once (multiprocessing's forkserver, kept for the session), instead of
# starting as fresh interpreters: a fresh rank spends about 2.5 s of CPU on those imports, which
# over the suite's launches was most of its time (a 2-rank launch of a tiny run: 3.7 s -> 0.8 s).
# Each rank is still its own process under torchrun's elastic agent, over gloo, with the
# launch's environment, working directory, output and exit status. The `kiln launch` command
# itself, with fresh interpreters, is what the tests that start it with `start` run.
# Hugging Face runs import transformers, its Llama model and peft in every rank (about 3 s of
# CPU a rank), runs that score tasks lm-eval (0.6 s); the server imports them once too (skipped
# where the extras are not installed).
_PRELOAD = [
    "kilnrun",
    "torch._dynamo",
    "kiln.cli",
    "kiln.train.trainer",
    "transformers.models.llama.modeling_llama",
    "peft",
    "kiln.harness.model",  # lm-eval's, for the runs that score tasks
    "lm_eval.evaluator",
    "lm_eval.tasks",
]


def _warm_server() -> Any:
    """multiprocessing's forkserver context, its server (started at its first use, then kept)
    importing ``_PRELOAD``: what ``launch``'s ranks, ``spawn`` and ``forked`` fork from."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(_PRELOAD)
    return multiprocessing.get_context("forkserver")


_SERVER_ENV = dict(os.environ)  # in the fork server: the environment a forked rank starts with
_THREADS = torch.get_num_threads()  # a fresh interpreter's intra-op threads, without OMP_NUM_THREADS


def _rank(env: dict[str, str], cwd: str, out: str, err: str, *argv: str) -> None:
    """One rank of ``launch``, in a process forked from the server: made what a fresh rank is,
    then ``kiln ARGV``."""
    elastic = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}  # the agent's per-rank variables
    _kiln_here({**env, **elastic}, cwd, out, err, argv)


def _kiln_here(env: dict[str, str], cwd: str, out: str, err: str, argv: tuple[str, ...]) -> None:
    """In a process forked from the server: made what ``kiln ARGV`` started with ``env`` in ``cwd``
    is, printing to the files ``out`` and ``err``; then ``kiln ARGV``, exiting with its status."""
    import io

    _started_with(env)
    os.chdir(cwd)
    sys.path[:0] = [p for p in (str(TESTS), str(EXAMPLES)) if p not in sys.path]
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(opened, fd)
        os.close(opened)
    # Unbuffered, as torchrun runs a rank (python -u): what a rank prints before os._exit stays.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "wb", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "wb", closefd=False), write_through=True)
    from kiln.cli import main

    code = main(list(argv))
    if code:
        sys.exit(code)


def forked(*args: Any, output: Path | None = None) -> Any:
    """``kiln ARGS...`` started in a process forked from the server of ``launch``'s ranks (a
    ``multiprocessing.Process``), what it prints appended to ``output`` (or discarded): for runs
    killed with a signal, which a fresh interpreter would first spend seconds of imports on."""
    to = str(output) if output else os.devnull
    run = (environment(), os.getcwd(), to, to, tuple(map(str, args)))
    proc = _warm_server().Process(target=_kiln_here, args=run)
    proc.start()
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

    torchrun's agent runs in this process, with the command line ``kiln launch`` gives it, and
    its ranks are forked from a warm server (above). What the agent and the ranks print is read
    from this process's file descriptors; the environment and the signal handlers torchrun sets
    are put back afterwards. Past ``timeout`` seconds the ranks are killed and the test fails.
    (Tests that signal the launcher's process start it with ``start``.)"""
    import argparse
    import contextlib
    import tempfile
    import threading
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from kiln.distributed.launch import add_arguments, failed_exit_code, prepare_agent, torchrun_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = torchrun_args(
        parser.parse_args(["--nproc-per-node", str(nproc), *map(str, launch_args), "--", *map(str, args)])
    )
    saved_env = dict(os.environ)
    handled = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    saved_handlers = {sig: signal.getsignal(sig) for sig in handled}
    expired = threading.Event()

    def kill_ranks() -> None:
        expired.set()
        for pid in _descendants():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill_ranks)
    _warm_server()
    with tempfile.NamedTemporaryFile("ab+") as out, tempfile.NamedTemporaryFile("ab+") as err:
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
                prepare_agent(argv)
                targs = parse_args(["--start-method", "forkserver", *argv])
                if targs.standalone:
                    # torchrun's static rendezvous on a free port: the c10d one that --standalone
                    # asks for (as torchrun's run() resolves it) first waits a random 0-0.3 s (to
                    # spread many nodes' joins), a fifth of a tiny launch; a group restarted needs
                    # c10d's rounds.
                    static = targs.max_restarts == 0
                    targs.rdzv_backend = "static" if static else "c10d"
                    targs.rdzv_endpoint = f"127.0.0.1:{free_port()}" if static else "localhost:0"
                    targs.rdzv_id = str(uuid.uuid4())
                config, _, _ = config_from_args(targs)  # sets OMP_NUM_THREADS here, for the ranks
                try:
                    elastic_launch(config, _rank)(dict(os.environ), os.getcwd(), out.name, err.name, *map(str, args))
                    code = 0
                except ChildFailedError as e:
                    code = failed_exit_code(e)
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
            command("launch", *argv), code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
        )
    if expired.is_set():
        raise AssertionError(
            f"kiln {' '.join(map(str, args))} ran past {timeout} s\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        )
    if check and code != 0:
        # A rank's fatal signal is named at the head of its dump, which the tail may have cut.
        fatal = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("Fatal Python error"))
        raise AssertionError(
            f"kiln {' '.join(map(str, args))} exited {code}\n{fatal}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def free_port() -> int:
    """A TCP port on the loopback interface that nothing holds now, below the kernel's range of
    ephemeral ports (where it has one), so that no connection made meanwhile (gloo's, another
    test's) is given it before the caller binds it."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.SystemRandom()  # not the module's generator, which the runs in this process seed
    for _ in range(100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", draw.randrange(10000, low) if low > 10000 else 0))
            except OSError:
                continue  # held
            return s.getsockname()[1]
    raise RuntimeError("no free TCP port found")


def join_as(rank: int, world_size: int, port: int) -> None:
    """This process's environment made torchrun's for ``rank`` of ``world_size`` processes on
    this machine meeting at ``port``: what kiln's ``init_world`` joins the group from."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def spawn(fn: Any, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each process forked from the warm server
    of ``launch``'s ranks (PyTorch, transformers and kiln imported once) instead of started as a
    fresh interpreter; each runs ``fn(i, *args)`` with this process's environment and thread
    count, and a failure in any is raised here, as ``spawn`` raises it."""
    import torch.multiprocessing as mp

    _warm_server()
    env = environment()
    mp.start_processes(_spawned, args=(fn, env, args), nprocs=nprocs, join=True, start_method="forkserver")


def _spawned(i: int, fn: Any, env: dict[str, str], args: tuple) -> None:
    _started_with(env)
    fn(i, *args)


def _started_with(env: dict[str, str]) -> None:
    """A process forked from the server made as a fresh one started with ``env`` would be: its
    environment, and the intra-op threads its OMP_NUM_THREADS asks for."""
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or _THREADS))


def _descendants() -> list[int]:
    """The processes below this one: the fork server's ranks as well as its own children."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    parents = dict(tuple(map(int, line.split())) for line in out.splitlines())
    found, mine = [], {os.getpid()}
    while True:
        more = [pid for pid, ppid in parents.items() if ppid in mine and pid not in found]
        if not more:
            return found
        found += more
        mine = set(more)


def peak_rss_of(*args: object, expect: int = 0) -> tuple[int, str]:
    """The peak resident memory (bytes) of ``kiln ARGS...``, measured by a parent process whose
    only child it is, and what it wrote to stderr; the command must exit ``expect``."""
    probe = (
        "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *command(*args)], capture_output=True, text=True, env=environment(), timeout=600
    )
    assert proc.returncode == expect, proc.stderr[-3000:]
    return int(proc.stdout.strip().splitlines()[-1]) * 1024, proc.stderr


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

    weights, state = load_checkpoint(path, with_state=True)
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
    proc = forked("train", *sets(items), "--set", f"run.dir={killed}")
    deadline, seen = time.time() + 120, []
    while time.time() < deadline:
        seen = list(losses(killed)) if (killed / "metrics.jsonl").exists() else []
        if seen and seen[-1] >= kill_after:
            break
        time.sleep(0.02)
    proc.kill()  # SIGKILL
    proc.join()
    steps = int(next(s.split("=")[1] for s in items if s.startswith("train.max_steps=")))
    assert seen and seen[-1] < steps, "the run finished before it could be killed"
    in_process("train", *sets(items), "--set", f"run.dir={killed}")
    assert losses(killed) == losses(full)
    from kiln.train.run import load_run

    a, b = load_run(full, device="cpu").model.state_dict(), load_run(killed, device="cpu").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
