"""The same 100-step `kiln train` in one process and in each 2-rank layout (DDP, FSDP, tensor
parallel, pipeline parallel), its loss and gradient norm at every log point and its evaluations,
written as JSON: run it on two source trees (a refactor's before and after) and compare.

    python bench/layout_curves.py OUT_DIR [--src SRC_DIR] [--layouts one ddp2 ...]

``--src`` is put first on PYTHONPATH, so a second checkout (``git worktree add``) of kiln runs
with the same interpreter and packages. Data is prepared once into OUT_DIR/cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

COMMON = [
    "train.max_steps=100",
    "train.micro_batch_size=8",
    "train.global_batch_size=32",
    "train.log_every=10",
    "eval.every=50",
    "checkpoint.every=50",
    "checkpoint.resume=never",
    "data.num_workers=0",
    "run.device=cpu",
]
LAYOUTS = {
    "one": ([], 0),
    "ddp2": (["parallel.strategy=ddp"], 2),
    "fsdp2": (["parallel.strategy=fsdp"], 2),
    "tp2": (["parallel.strategy=fsdp", "parallel.tp=2"], 2),
    "pp2": (["parallel.pp=2"], 2),
}
KEPT = ("step", "loss", "grad_norm", "val_loss", "val_bpb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--src", type=Path, help="a kiln source tree (its src/) to run instead of the installed one")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = ap.parse_args()
    env = {**os.environ, "KILN_CACHE": str(args.out / "cache"), "OMP_NUM_THREADS": "1"}
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.src), os.environ.get("PYTHONPATH")]))
    for name in args.layouts:
        sets, nproc = LAYOUTS[name]
        run = args.out / name
        shutil.rmtree(run, ignore_errors=True)
        overrides = [a for s in [f"run.dir={run}", *COMMON, *sets] for a in ("--set", s)]
        launch = ["launch", "--nproc-per-node", str(nproc), "--"] if nproc else []
        proc = subprocess.run(
            [sys.executable, "-m", "kiln", *launch, "train", *overrides], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        curve = [{k: r[k] for k in KEPT if k in r} for r in records if "loss" in r or "val_loss" in r]
        (args.out / f"{name}.json").write_text(json.dumps(curve, indent=1))
        print(name, [(r["step"], r.get("loss", r.get("val_loss"))) for r in curve], flush=True)


if __name__ == "__main__":
    main()
