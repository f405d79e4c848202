"""The hang watchdog: a job whose ranks stop making progress (one never arrives at a collective,
or a collective never completes) is described and ended, so that ``kiln launch --max-restarts``
restarts it from its last checkpoint, instead of waiting until the process group's timeout or
forever.

Each rank runs one daemon thread. The loop tells it where it is with ``beat(step, phase)``, two
attribute writes and no sync. With no beat for ``parallel.init_timeout`` (until the first step of
this process is done; the loop's long phases, evaluation and checkpoint saves, keep it) or
``parallel.train_timeout`` (after that), the thread declares a hang in the process group's store,
where the other ranks' threads see it within a tick. Then every rank writes, under
``RUN_DIR/hang/<time>/``, its Python stacks (``rank-N.txt``, every thread), its flight-recorder
trace where the backend keeps one (``flight-recorder-rank-N.json``) and an account of itself
(``rank-N.json``: host, pid, steps done, phase, seconds since its last beat, where its main
thread is, the last collective it enqueued in each process group), and puts that account in the
store. The rank that declared the hang gathers the accounts, names the rank that did not arrive
and the collective the others wait in (``summary.txt``, ``summary.json`` and stderr), and every
rank exits with ``HANG_EXIT``. Reports go through the store, not the file system: the run
directories of several nodes need not be shared.

The process groups' own timeouts are set a little longer than the watchdog's, so the watchdog
speaks first; they remain the backstop where a rank's Python cannot run (a C call that holds the
GIL). ``kill -USR1`` on a rank appends its stacks to ``RUN_DIR/hang/stacks-rank-N.txt``, at any
time once training has started, and in a single process too. Nothing is written under the run
directory before then, so a run refused during its setup leaves none behind.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

# The exit status of every rank of a hung job (the CLI's own errors use 2 to 4).
HANG_EXIT = 5
HANG_DIR = "hang"
# The variables of collective_env and their values (the dump file's is the run's).
_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_BUFFER_SIZE": "2000",
}
_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
# Older names torch still reads for two of the variables: a user's value under either one wins.
_ALIASES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}


def collective_env(run_dir: str | Path | None, nccl: bool) -> dict[str, str]:
    """The variables that make NCCL and the flight recorder report a hang, as the watchdog sets
    them (a value the user set, under the name or its older alias, wins):

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: when NCCL's own watchdog finds a collective timed out,
    it ends the process (so the agent can restart it) without aborting the communicators first,
    the mode in which it can write its flight recorder;
    ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: it writes that flight recorder on a timeout;
    ``TORCH_FR_BUFFER_SIZE=2000``: the collectives the flight recorder keeps (NCCL and gloo; older
    name ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 0 turns it off);
    ``TORCH_FR_DUMP_TEMP_FILE=RUN_DIR/hang/nccl-trace-rank-``: where NCCL's watchdog writes it, the
    rank appended (older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; NCCL only).
    """
    wanted = dict(_ENV_DEFAULTS)
    if nccl and run_dir is not None:
        wanted[_DUMP_FILE] = str(Path(run_dir) / HANG_DIR / "nccl-trace-rank-")
    return {k: v for k, v in wanted.items() if k not in os.environ and _ALIASES.get(k, k) not in os.environ}


def set_collective_env(run_dir: str | Path | None, nccl: bool) -> None:
    """Set ``collective_env``'s variables; before the process group exists, which reads them."""
    # The directory is made when training starts (``Watchdog.start``): a run refused before then
    # leaves nothing behind.
    os.environ.update(collective_env(run_dir, nccl))


class Watchdog:
    """One rank's watchdog (see the module). Made inactive (``size`` 1: nothing to wait on, only
    ``kill -USR1`` works) or for a rank of ``size``, with the two limits in seconds."""

    def __init__(self, rank: int = 0, size: int = 1, init_timeout_s: float = 600.0, train_timeout_s: float = 300.0):
        self.rank, self.size = rank, size
        self.init_s, self.train_s = init_timeout_s, train_timeout_s
        # Each tick the thread compares the time since the last beat with the limit; a rank that
        # has been quiet a tick also looks in the store for a hang another rank declared.
        self.tick_s = min(5.0, max(0.2, min(init_timeout_s, train_timeout_s) / 20))
        # How long the declaring rank waits for the others' accounts.
        self.grace_s = max(5.0, 4 * self.tick_s)
        self.run_dir: Path | None = None
        self.groups: list[Any] = []
        # (monotonic time, steps done, phase, patient): replaced whole, so the thread reads one beat.
        self._beat: tuple[float, int, str, bool] = (time.monotonic(), 0, "setting up", True)
        self._beats = 0  # ranks run the same loop: how far each got is comparable
        self._first_step: int | None = None
        self._trained = False  # the first step of this process is done: train_timeout applies
        self._resting = False
        self._stopped = False
        self._ending = False  # the thread is dumping and reporting a hang, then exits the process
        self._thread: threading.Thread | None = None
        self._stacks_file: TextIO | None = None  # kept open: faulthandler writes to its descriptor on SIGUSR1
        self._store: Any = None

    # -- what the loop calls ------------------------------------------------------------------

    def beat(self, step: int, phase: str, *, patient: bool = False) -> None:
        """This rank has done ``step`` steps and is entering ``phase`` (named in the report);
        a ``patient`` phase (evaluation, a checkpoint) keeps the init timeout."""
        self._beat = (time.monotonic(), step, phase, patient)
        self._beats += 1
        self._resting = False
        if self._first_step is None:
            self._first_step = step
        elif step > self._first_step and not self._trained:
            self._trained = True
            self._set_timeouts(self.train_s)

    @contextlib.contextmanager
    def watching(self, run_dir: str | Path) -> Iterator[None]:
        """Watch until the block (the loop) ends, reporting into ``run_dir``; after it the rank
        rests until its next beat (a process may do long work of its own after training)."""
        self.start(run_dir)
        try:
            yield
        except BaseException:
            if self._ending and self._thread is not None:
                # A peer that exited for the hang broke this rank's collective: its error must
                # not end the process before the thread's report and HANG_EXIT, or the agent
                # sees a crash instead of a hang.
                self._thread.join()
            raise
        finally:
            self._resting = True

    # -- set up by init_world -----------------------------------------------------------------

    def collective_timeout(self, limit_s: float | None = None) -> timedelta:
        """The process groups' timeout for a watchdog limit: long enough for the watchdog to
        declare the hang, gather the reports and exit before a collective gives up."""
        return timedelta(seconds=(limit_s or self.init_s) + self.tick_s + self.grace_s + 10)

    def watch_groups(self, groups: list[Any]) -> None:
        """The process groups whose timeouts follow the watchdog's (now the init timeout's);
        None is the default group."""
        for group in groups:
            if not any(group is g for g in self.groups):
                self.groups.append(group)
        self._set_timeouts(self.train_s if self._trained else self.init_s)

    def start(self, run_dir: str | Path) -> None:
        """Write reports under ``run_dir``: ``kill -USR1`` from now on, and on a hang when the
        process is one rank of several (a later run in the same process moves them)."""
        run_dir = Path(run_dir)
        if run_dir == self.run_dir:
            return
        self.run_dir = run_dir
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no dumps on demand, rather than no run
            path = run_dir / HANG_DIR / f"stacks-rank-{self.rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            stacks = open(path, "a")  # noqa: SIM115 - faulthandler writes to it until the next start
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
            if self._stacks_file is not None:
                self._stacks_file.close()
            self._stacks_file = stacks
        if self.size > 1 and self._thread is None:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
            self._beat = (time.monotonic(), *self._beat[1:])
            self._thread = threading.Thread(target=self._watch, name="kiln-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """The process leaves the process group: no more watching, no more dumps on demand."""
        self._stopped = True
        if self._stacks_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks_file.close()
            self._stacks_file = None

    # -- the thread -----------------------------------------------------------------------------

    def _set_timeouts(self, limit_s: float) -> None:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        for group in self.groups:
            _set_pg_timeout(self.collective_timeout(limit_s), group)

    def _key(self, name: str) -> str:
        # Restarted workers may meet in the same store: each attempt has its own keys.
        return f"kiln/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"

    def _watch(self) -> None:
        while not self._stopped:
            time.sleep(self.tick_s)
            when, _, _, patient = self._beat
            if self._resting or self._stopped:
                continue
            quiet = time.monotonic() - when
            key = "init_timeout" if patient or not self._trained else "train_timeout"
            limit = self.init_s if key == "init_timeout" else self.train_s
            if quiet > limit:
                self._end(declared=f"rank {self.rank} made no progress for {quiet:.0f}s, parallel.{key}={limit:g}s")
            elif quiet > self.tick_s and self._seen_declared():
                self._end(declared=None)

    def _seen_declared(self) -> bool:
        try:
            return self._store.check([self._key("declared")])
        except Exception:  # the store's host (rank 0) is gone: the agent is ending the job anyway
            return False

    def _end(self, declared: str | None) -> None:
        """Dump, report and exit (this rank found the hang when ``declared`` says why)."""
        self._ending = True
        stamp = time.strftime("%Y%m%d-%H%M%S")
        reporter = False
        try:
            if declared is not None:
                mine = f"{stamp}|{self.rank}|{declared}"
                reporter = self._store.compare_set(self._key("declared"), "", mine).decode() == mine
            stamp, _, declared = self._store.get(self._key("declared")).decode().split("|", 2)
            store_ok = True
        except Exception:  # no store: this rank reports what it knows, alone
            store_ok, reporter = False, True
        assert self.run_dir is not None  # the thread that calls this starts once it is set (start)
        out = self.run_dir / HANG_DIR / stamp
        account = self._write_dumps(out)
        if not reporter:
            print(
                f"kiln [rank {self.rank}]: hang declared ({declared}); stacks in {out / f'rank-{self.rank}.txt'}",
                file=sys.stderr,
                flush=True,
            )
        if store_ok:
            with contextlib.suppress(Exception):
                self._store.set(self._key(f"rank-{self.rank}"), json.dumps(account))
        if reporter:
            accounts = self._gather() if store_ok else {self.rank: account}
            self._report(out, accounts, declared)
            with contextlib.suppress(Exception):
                self._store.set(self._key("reported"), "1")
        elif store_ok:
            self._await_report()
        os._exit(HANG_EXIT)

    def _write_dumps(self, out: Path) -> dict[str, Any]:
        when, step, phase, _ = self._beat
        account = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": step,
            "phase": phase,
            "quiet_s": round(time.monotonic() - when, 1),
            "beats": self._beats,
            "where": _main_thread_frames(),
            "collectives": {},
            "env": {k: os.environ.get(k) for k in (*_ENV_DEFAULTS, _DUMP_FILE, *_ALIASES.values()) if k in os.environ},
        }
        try:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"rank-{self.rank}.txt", "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
            records = flight_records()
            if records:
                (out / f"flight-recorder-rank-{self.rank}.json").write_text(json.dumps(records))
                account["collectives"] = last_collectives(records)
            (out / f"rank-{self.rank}.json").write_text(json.dumps(account, indent=2))
        except OSError as e:
            print(f"kiln [rank {self.rank}]: could not write the hang dumps to {out}: {e}", file=sys.stderr)
        return account

    def _gather(self) -> dict[int, dict[str, Any]]:
        keys = {r: self._key(f"rank-{r}") for r in range(self.size)}
        deadline = time.monotonic() + self.grace_s
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and not self._store.check(list(keys.values())):
                time.sleep(0.1)
        accounts = {}
        for rank, key in keys.items():
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    accounts[rank] = json.loads(self._store.get(key))
        return accounts

    def _await_report(self) -> None:
        deadline = time.monotonic() + self.grace_s + 5
        with contextlib.suppress(Exception):  # the reporter's exit may take the store with it
            while time.monotonic() < deadline and not self._store.check([self._key("reported")]):
                time.sleep(0.1)

    def _report(self, out: Path, accounts: dict[int, dict[str, Any]], declared: str | None) -> None:
        summary = describe(accounts, self.size, declared)
        summary["dir"] = str(out)
        text = summary["text"] + f"\nkiln: stacks, flight recorder and accounts of each rank in {out}/"
        with contextlib.suppress(OSError):
            out.mkdir(parents=True, exist_ok=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            (out / "summary.txt").write_text(text + "\n")
        print(text, file=sys.stderr, flush=True)


# -- reading the state of a hung rank ---------------------------------------------------------


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return os.path.basename(path)


def _main_thread_frames(depth: int = 4) -> list[str]:
    """The innermost Python frames of the main thread (where it waits or is stuck)."""
    main = threading.main_thread().ident
    assert main is not None  # the main thread has started
    frame = sys._current_frames().get(main)
    if frame is None:
        return []
    return [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)[-depth:]]


def flight_records() -> dict[str, Any]:
    """This process's flight-recorder traces, by recorder: "nccl" (NCCL collectives, on builds
    with NCCL) and "cpu" (gloo's and the other CPU backends'); empty where none is kept."""
    import torch

    records = {}
    for name, binding in (("nccl", "_dump_nccl_trace_json"), ("cpu", "_dump_fr_trace_json")):
        dump = getattr(torch._C._distributed_c10d, binding, None)
        if dump is None:
            continue
        with contextlib.suppress(Exception):
            trace = json.loads(dump(True, False))
            if trace.get("entries"):
                records[name] = trace
    return records


def last_collectives(records: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The last collective this rank enqueued in each process group (point-to-point operations
    left out), by the group's name, from its flight-recorder traces."""
    last: dict[str, dict[str, Any]] = {}
    for trace in records.values():
        for entry in trace.get("entries", []):
            if entry.get("is_p2p"):
                continue
            name, desc = (list(entry.get("process_group") or ["?", ""]) + [""])[:2]
            seq = int(entry.get("collective_seq_id", 0))
            if seq >= last.get(name, {}).get("seq", -1):
                last[name] = {
                    "seq": seq,
                    "op": entry.get("profiling_name", "?"),
                    "group": desc if desc and desc != "undefined" else f"group {name}",
                    "sizes": entry.get("input_sizes"),
                }
    return last


def _collective(c: dict[str, Any]) -> str:
    return f"{c['op']} #{c['seq']} of {c['group']}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe(accounts: dict[int, dict[str, Any]], size: int, declared: str | None = "") -> dict[str, Any]:
    """Which ranks held the others up, from their accounts (``Watchdog._write_dumps``): a rank
    behind the others in some group's collectives and ahead in none did not arrive (the others
    wait in the collective it never enqueued); without flight-recorder traces, a rank whose loop
    beat fewer times is behind. Ranks with no account are named apart (a dead process, or one
    whose Python cannot run)."""
    missing = [r for r in range(size) if r not in accounts]
    behind: dict[int, list[str]] = {}
    ahead: set[int] = set()
    groups = sorted({g for a in accounts.values() for g in a.get("collectives", {})})
    for g in groups:
        seqs = {r: a["collectives"][g]["seq"] for r, a in accounts.items() if g in a.get("collectives", {})}
        top = max(seqs.values())
        if min(seqs.values()) == top:
            continue
        leaders = sorted(r for r, q in seqs.items() if q == top)
        ahead.update(leaders)
        waits = "waits" if len(leaders) == 1 else "wait"
        awaited = f"{_collective(accounts[leaders[0]]['collectives'][g])}, which {_ranks(leaders)} {waits} in"
        for r, q in seqs.items():
            if q < top:
                behind.setdefault(r, []).append(awaited)
    culprits = sorted(set(behind) - ahead)
    how = "flight recorder"
    if not culprits and not behind and accounts:
        beats = {r: a["beats"] for r, a in accounts.items()}
        top = max(beats.values())
        culprits = sorted(r for r, b in beats.items() if b < top)
        how = "loop progress"
    lines = [f"kiln: hang: {declared}" if declared else "kiln: hang"]
    for r in culprits:
        a = accounts[r]
        if r in behind:
            lines.append(f"kiln: rank {r} on {a['host']} did not arrive at {'; '.join(behind[r])}")
        else:
            lines.append(
                f"kiln: rank {r} on {a['host']} is behind the others: still in {a['phase']!r} after {a['step']} steps"
            )
    if not culprits:
        if behind:
            lines.append("kiln: the ranks wait in different collectives (a desync): see each rank's last collective")
        elif not missing:
            lines.append(
                "kiln: no rank is behind: every rank waits in the same place (a stalled collective, network or device)"
            )
    if missing:
        lines.append(f"kiln: {_ranks(missing)} sent no report (the process is gone, or its Python cannot run)")
    for r, a in sorted(accounts.items()):
        last = "; ".join(_collective(c) for c in a.get("collectives", {}).values())
        where = a["where"][-1] if a.get("where") else "?"
        lines.append(
            f"kiln:   rank {r} ({a['host']}, pid {a['pid']}): {a['step']} steps done, in {a['phase']!r}, "
            f"quiet {a['quiet_s']}s, main thread at {where}" + (f"; last collectives: {last}" if last else "")
        )
    return {"culprits": culprits, "missing": missing, "evidence": how, "accounts": accounts, "text": "\n".join(lines)}
