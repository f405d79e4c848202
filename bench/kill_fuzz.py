"""Random SIGKILLs, resumed: a run killed again and again at random moments (inside training steps,
checkpoint writes and evaluations) and restarted with the same command each time ends with the
losses at every logged step and the weights, bit for bit, of the same run never stopped.

    python bench/kill_fuzz.py [--kills 30] [--nproc 2] [--strategy fsdp] [--steps 400]

Each attempt is ``kiln launch --nproc-per-node N -- train ...`` (or ``kiln train`` with --nproc 1)
in its own session, killed with SIGKILL as a whole (the launcher and every rank) a random time
into its training; the run directory is then resumed by the next attempt. A checkpoint every 5 steps, each
write slowed by 50 ms (``debug.slow_save_seconds``, so that kills land inside writes too), and an
evaluation every 20 steps. Prints a line per kill (where it landed: the step last logged, whether
a checkpoint was being written) and one JSON line with the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from kiln.train.run import load_run


def corpus(root: Path) -> Path:
    out = root / "corpus"
    out.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:40]:
        (out / f"{path.stem}.txt").write_text(path.read_text(encoding="utf-8", errors="replace")[:20000])
    return out


def command(run: Path, data: Path, args: argparse.Namespace) -> list[str]:
    items = {
        "run.dir": run,
        "data.source": data,
        "data.vocab_size": 512,
        "data.seq_len": 32,
        "data.num_workers": 0,
        "model.n_layer": 2,
        "model.d_model": 64,
        "model.n_head": 4,
        "model.n_kv_head": 2,
        "model.d_ff": 128,
        "train.max_steps": args.steps,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "train.lr": 1e-2,
        "train.log_every": 1,
        "eval.every": 20,
        "eval.batches": 2,
        "eval.sample_tokens": 0,
        "checkpoint.every": 5,
        "checkpoint.keep": 2,
        "debug.slow_save_seconds": 0.05,
        "parallel.strategy": args.strategy if args.nproc > 1 else "ddp",
    }
    sets = [a for k, v in items.items() for a in ("--set", f"{k}={v}")]
    kiln = [sys.executable, "-m", "kiln"]
    if args.nproc == 1:
        return [*kiln, "train", *sets]
    return [*kiln, "launch", "--nproc-per-node", str(args.nproc), "--", "train", *sets]


def losses(run: Path) -> dict[int, float]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kiln-kill-fuzz-"))
    env = {**os.environ, "KILN_CACHE": str(root / "cache")}
    data = corpus(root)

    reference = root / "reference"
    started, first_s = time.perf_counter(), None
    proc = subprocess.Popen(
        command(reference, data, args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while proc.poll() is None:
        if first_s is None and losses(reference):
            first_s = time.perf_counter() - started
        time.sleep(0.005)
    if proc.returncode != 0 or first_s is None:
        print(f"the uninterrupted run exited {proc.returncode}", flush=True)
        return 1
    whole_s = time.perf_counter() - started
    # A kill lands a random time into an attempt's training, from a little before its first step:
    # on average each attempt trains 1/kills of the run, so the kills spread over all of it.
    window = 2 * (whole_s - first_s) / args.kills
    print(f"uninterrupted: {whole_s:.1f} s, the first step logged at {first_s:.1f} s", flush=True)

    run, kills, landed, start_s = root / "killed", 0, [], first_s
    while True:
        proc = subprocess.Popen(
            command(run, data, args),
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if kills < args.kills:
            # From a little before this attempt's first step (as long after its start as the last
            # attempt's first step came: a resumed run starts sooner than a fresh one).
            began, before, moved = time.perf_counter(), max(losses(run), default=0), None
            deadline = began + 0.8 * start_s + rng.uniform(0, window)
            while time.perf_counter() < deadline and proc.poll() is None:
                if moved is None and max(losses(run), default=0) > before:
                    moved = time.perf_counter() - began
                time.sleep(0.005)
            start_s = moved or start_s
            if proc.poll() is None:
                writing = any((run / "checkpoints").glob(".tmp-*")) if (run / "checkpoints").exists() else False
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                kills += 1
                step = max(losses(run), default=0)
                landed.append({"step": step, "writing": writing})
                print(
                    f"kill {kills:2d}: after step {step}{' (inside a checkpoint write)' if writing else ''}", flush=True
                )
                continue
        if proc.wait() != 0:
            print(f"attempt exited {proc.returncode}", flush=True)
            return 1
        if max(losses(run), default=0) >= args.steps:
            break

    same_losses = losses(run) == losses(reference)
    a = load_run(reference, device="cpu").model.state_dict()
    b = load_run(run, device="cpu").model.state_dict()
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result = {
        "kills": kills,
        "inside_writes": sum(k["writing"] for k in landed),
        "nproc": args.nproc,
        "strategy": args.strategy if args.nproc > 1 else "one process",
        "steps": args.steps,
        "same_losses": same_losses,
        "bitwise_same_weights": same_weights,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0 if same_losses and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
