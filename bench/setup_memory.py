"""Per-rank peak memory and setup time of starting a large model, measured from outside.

    python bench/setup_memory.py --nproc 2 [--preset 1b --n-layer 24] [--lora 8] [--src DIR]

Runs ``kiln launch --nproc-per-node N -- train`` (``kiln train`` for N = 1) for one step of a
kiln GPT on a small generated corpus, polls the peak resident set (VmHWM) of every process the
launch starts, and prints each worker's peak beside the whole model's fp32 bytes, with the
run's own ``setup:`` line. ``--src`` runs another kiln source tree (its ``src/``), to measure a
version before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def peak_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def is_worker(pid: int) -> bool:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"train" in args and b"launch" not in args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--lora", type=int, default=8, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--src", type=Path, help="a kiln source tree's src/ to run instead of the installed kiln")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.txt"
        corpus.write_text(
            "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 97}" for i in range(20000))
        )
        sets = {
            "run.dir": tmp / "run",
            "data.source": corpus,
            "data.seq_len": 64,
            "data.num_workers": 0,
            "model.preset": args.preset,
            "model.n_layer": args.n_layer,
            "parallel.strategy": "fsdp",
            "train.max_steps": 1,
            "train.micro_batch_size": 1,
            "train.global_batch_size": args.nproc,
            "train.log_every": 1,
            "eval.every": 0,
            "eval.batches": 1,
            "eval.sample_tokens": 0,
            "checkpoint.every": 0,
        }
        if args.lora:
            sets["lora.rank"] = args.lora
        items = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        kiln = [sys.executable, "-m", "kiln"]
        cmd = (
            [*kiln, "train", *items]
            if args.nproc == 1
            else [*kiln, "launch", "--nproc-per-node", str(args.nproc), "--", "train", *items]
        )
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.src:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.src.resolve()), env.get("PYTHONPATH")]))
        began = time.perf_counter()
        log = (tmp / "output.txt").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        peaks: dict[int, int] = {}
        workers: set[int] = set()
        first_step: dict[int, int] = {}  # each worker's peak when the run said its setup line
        while proc.poll() is None:
            if not first_step and "setup:" in (tmp / "output.txt").read_text():
                first_step = {pid: peaks.get(pid, 0) for pid in workers}
            for pid in descendants(proc.pid):
                if pid not in workers and is_worker(pid) and pid != proc.pid or (args.nproc == 1 and pid == proc.pid):
                    workers.add(pid)
                if (kib := peak_kib(pid)) is not None:
                    peaks[pid] = max(peaks.get(pid, 0), kib)
            time.sleep(0.1)
        wall = time.perf_counter() - began
        log.close()
        text = (tmp / "output.txt").read_text()
        if proc.returncode:
            sys.exit(f"kiln exited {proc.returncode}:\n{text[-3000:]}")

    sys.path.insert(0, str(args.src or Path(__file__).parents[1] / "src"))
    import torch

    from kiln.config import ModelConfig
    from kiln.models.gpt import GPT, build_gpt_config

    with torch.device("meta"):
        model = GPT(build_gpt_config(ModelConfig(preset=args.preset, n_layer=args.n_layer), 4096, 64))
    whole = 4 * model.num_params()
    worker_peaks = sorted((peaks[p] * 1024 for p in workers if p in peaks), reverse=True)
    setup_peaks = sorted((first_step.get(p, 0) * 1024 for p in workers), reverse=True)
    setup = next((line.split("kiln: ", 1)[1] for line in text.splitlines() if "setup:" in line), None)
    print(
        json.dumps(
            {
                "nproc": args.nproc,
                "preset": args.preset,
                "n_layer": args.n_layer,
                "lora": args.lora,
                "params": model.num_params(),
                "whole_fp32_gb": whole / 1e9,
                "worker_peak_rss_gb": [round(b / 1e9, 3) for b in worker_peaks],
                "peak_over_whole": round(worker_peaks[0] / whole, 3) if worker_peaks else None,
                "peak_through_first_step_gb": [round(b / 1e9, 3) for b in setup_peaks],
                "wall_s": round(wall, 1),
                "setup": setup,
            }
        )
    )


if __name__ == "__main__":
    main()
