"""kiln on one GPU: the device's measured ceilings, kiln's tokens/s and MFU at bf16 and fp8,
a hand-written compiled loop of the same model, peak memory against `kiln plan`, and fp8's loss
against bf16's. One process, stages in order, each skipped when the deadline would cut it.

    python bench/gpu.py --out DIR [--deadline 480] [--stages ceilings,chunk,small,profile,hand,large,fp8,loss]
        [--small-micro 16,32] [--loss-chunk default|best|ROWS]

(`--device cpu --small tiny --large tiny --steps 12 --loss-steps 12` runs the same code on a CPU
in a minute, to check the script before it spends GPU time.)

Every stage appends one JSON line to DIR/gpu.jsonl as soon as it ends, so a run cut short
keeps what it measured, and a stage that fails records its error and the next one runs; a table
of all of them is printed last. The `chunk` stage times the fused loss (projection and
cross-entropy, forward and backward) alone at several rows per chunk, eager and compiled; with
`--loss-chunk best` the later stages train with its fastest compiled size. Data: uniformly random tokens
for throughput (the work does not depend on the values), the bytes of kiln's own source for the
loss comparison (text a model can learn)."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

import kiln.models.fused_loss as fused_loss
import kiln.models.gpt.memory as gpt_memory
from kiln import Trainer
from kiln.config import ModelConfig, load_config
from kiln.data import TokenSequences
from kiln.data.loader import make_train_loader
from kiln.device import peak_flops
from kiln.models import GPT, build_gpt_config
from kiln.models.lm import lm_loss
from kiln.plan import make_plan
from kiln.train.optim import build_optimizer, lr_at

from common import kiln_tokens_per_s, random_tokens

VOCAB = 50304  # GPT-2's 50257, padded to a multiple of 128 as nanoGPT does
LOG_EVERY = 4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, reps: int, device: torch.device) -> float:
    """Median wall time of ``fn`` over ``reps`` device-synchronised calls, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ceilings(device: torch.device) -> dict:
    """bf16 matrix rate (8192^3 on a GPU, random data) and copy bandwidth (4 GiB), medians."""
    n, size = (8192, 2**30) if device.type == "cuda" else (1024, 2**24)
    a, b = (
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
    )
    src = torch.randn(size, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    matmul = median_seconds(lambda: a @ b, 20, device)
    copy = median_seconds(lambda: dst.copy_(src), 20, device)
    return {"bf16_matmul_tflops": 2 * n**3 / matmul / 1e12, "copy_tb_per_s": 2 * src.nbytes / copy / 1e12}


def loss_chunks(device: torch.device, rows: int, dim: int) -> dict:
    """Forward and backward of the fused loss alone at several chunk sizes: median ms of 10 after
    a first (compiling) call and 3 warm-ups, device-synchronised; peak allocated GiB over the
    timed calls; eager and compiled."""
    sizes = (256, 1024, 2048, 4096, 8192, 16384) if device.type == "cuda" else (64, 256)
    torch.manual_seed(0)
    hidden = torch.randn(rows, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(VOCAB, dim, device=device) * dim**-0.5).requires_grad_()
    targets = torch.randint(0, VOCAB, (rows,), device=device)
    out: dict = {"rows": rows, "dim": dim, "default": fused_loss.default_chunk_size(VOCAB, device.type)}
    for compiled in (False, True):
        for size in sizes if not compiled else sizes[1::2]:

            def loss_fn(h, w, t, size=size):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return fused_loss.linear_cross_entropy(h, w, t, chunk_size=size)

            fn = torch.compile(loss_fn) if compiled else loss_fn

            def step(fn=fn):
                hidden.grad = weight.grad = None
                fn(hidden, weight, targets).backward()

            step()  # a compiled loss compiles here: its memory stays out of the chunk's peak
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = 1e3 * median_seconds(step, 10, device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            out[f"{'compiled' if compiled else 'eager'} {size}"] = {"ms": round(ms, 3), "peak_gib": round(peak, 2)}
    compiled_ms = {int(k.split()[1]): v["ms"] for k, v in out.items() if k.startswith("compiled")}
    out["best_compiled"] = min(compiled_ms, key=compiled_ms.__getitem__)
    return out


def use_loss_chunk(rows: int) -> None:
    """Every later run's fused loss (and the plan's memory model of it) uses ``rows`` per chunk."""
    fused_loss.default_chunk_size = gpt_memory.default_chunk_size = lambda vocab, device="cpu": rows


def config(run_dir: Path, device: torch.device, preset: str, precision: str, steps: int, micro: int, seq: int, **extra):
    sets = [
        f"run.dir={run_dir}",
        f"run.device={device.type}",
        f"model.preset={preset}",
        f"data.seq_len={seq}",
        f"data.vocab_size={VOCAB}",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={micro}",
        f"train.precision={precision}",
        f"train.compile={str(device.type == 'cuda').lower()}",
        "train.warmup_steps=10",
        f"train.log_every={LOG_EVERY}",
        "data.num_workers=2",
        "eval.every=0",
        "checkpoint.every=0",
        "checkpoint.resume=never",
    ]
    return load_config(None, sets + [f"{k}={v}" for k, v in extra.items()])


def model_for(cfg) -> GPT:
    torch.manual_seed(0)
    return GPT(build_gpt_config(ModelConfig(preset=cfg.model.preset), VOCAB, cfg.data.seq_len))


def kiln_run(cfg, data: TokenSequences, after: int) -> dict:
    """kiln's Trainer; tokens/s from its metrics after step ``after`` (compile and warm-up)."""
    plan = make_plan(cfg)
    flops = plan.job.flops_per_token
    device = torch.device(cfg.run.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = Trainer(
        model_for(cfg), data, lm_loss, cfg, tokens_per_sample=data.seq_len, flops_per_token=flops, console=False
    ).fit()
    rate = kiln_tokens_per_s(cfg.run.dir, after)
    peak = peak_flops(device)
    # The loop resets the device's peak at each log: the run's peak is the largest interval's.
    records = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["memory/peak_allocated_gib"] for r in records if "memory/peak_allocated_gib" in r]
    # The last tenth of the run's logged losses: one interval's loss is a few batches' noise.
    logged = [r["loss"] for r in records if "loss" in r and r.get("step", 0) > 0.9 * cfg.train.max_steps]
    return {
        "tokens_per_s": rate,
        "mfu_datasheet": rate * flops / peak if peak else None,
        "flops_per_token": flops,
        "loss": result.metrics["loss"],
        "loss_last_tenth": statistics.fmean(logged) if logged else None,
        "peak_allocated_gib": max(peaks, default=None),
        "plan_allocated_gib": plan.memory.allocated / 2**30,
    }


def kernel_table(trace: Path, steps: int) -> dict:
    """The trace's device kernels summed by name: ms per step, largest first, and the share of the
    step the device was busy (kernels of one stream do not overlap)."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            kernels[e["name"]] = kernels.get(e["name"], 0.0) + e["dur"] / 1e3 / steps
    kinds = {"matmul": ("gemm", "nvjet", "cutlass", "xmma"), "attention": ("flash", "fmha", "attention")}
    by_kind = dict.fromkeys((*kinds, "other"), 0.0)
    for name, ms in kernels.items():
        kind = next((k for k, keys in kinds.items() if any(key in name.lower() for key in keys)), "other")
        by_kind[kind] += ms
    top = sorted(kernels.items(), key=lambda kv: kv[1], reverse=True)[:40]
    return {"kernel_ms_per_step": sum(kernels.values()), "by_kind_ms": by_kind, "top_kernels_ms": dict(top)}


def profiled(cfg, data: TokenSequences, after: int, out: Path) -> dict:
    """kiln's own profiler (`profile.steps`) over three steps after the compile: its breakdown, the
    kernels by device time, and the trace, gzipped, beside the results."""
    result = kiln_run(cfg, data, after)
    breakdown = json.loads((Path(cfg.profile.dir) / "breakdown.json").read_text())
    trace = Path(breakdown["trace"])
    start, end = breakdown["steps"]
    with trace.open("rb") as f, gzip.open(out / "profile-trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    return {**result, **breakdown, **kernel_table(trace, end - start + 1)}


def hand_written(cfg, data: TokenSequences, after: int) -> float:
    """The loop a person would write on a GPU: compiled model, fused AdamW, bf16 autocast, pinned
    batches copied without blocking, clipping; the same batches and parameter groups as kiln."""
    t, device = cfg.train, torch.device(cfg.run.device)
    model = model_for(cfg).to(device)
    opt = build_optimizer(model, t, device)
    step_fn = torch.compile(model) if t.compile else model
    cuda = device.type == "cuda"
    batches = iter(
        make_train_loader(data, schedule=t.global_batch_size, seed=t.seed, start_step=0, num_workers=2, pin_memory=cuda)
    )
    start = 0.0
    for step in range(t.max_steps):
        if step == after:
            sync(device)
            start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y = (b.to(device, non_blocking=True) for b in next(batches))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    return (t.max_steps - after) * t.global_batch_size * data.seq_len / (time.perf_counter() - start)


def text_tokens(path: Path, seq: int) -> TokenSequences:
    """The bytes of kiln's own source, as token ids: about 2 MB of text a model can learn."""
    import kiln

    root = Path(kiln.__file__).parent
    text = "\n".join(p.read_text() for p in sorted(root.rglob("*.py")))
    np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16).tofile(path)
    return TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=480, help="seconds; a stage that would pass it is skipped")
    ap.add_argument("--stages", default="ceilings,chunk,small,profile,hand,large,fp8,loss")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", default="gpt2-124m", help="preset of the small model")
    ap.add_argument("--large", default="1b", help="preset of the large model")
    ap.add_argument("--small-micro", default="16", help="comma-separated micro-batches of the small model")
    ap.add_argument(
        "--loss-chunk",
        default="default",
        help="rows per fused-loss chunk: default, best (from the chunk stage) or a number",
    )
    ap.add_argument("--large-micro", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40, help="steps of each throughput run; the first 20 are not timed")
    ap.add_argument("--loss-steps", type=int, default=300)
    args = ap.parse_args()
    began, stages = time.monotonic(), args.stages.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu.jsonl"
    rows: list[dict] = []
    device = torch.device(args.device)
    peak = peak_flops(device)
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "datasheet_bf16_tflops": peak / 1e12 if peak else None,
    }
    after = args.steps // 2
    print(json.dumps(header), flush=True)

    def record(stage: str, **values) -> None:
        row = {"stage": stage, "at_s": round(time.monotonic() - began, 1), **values}
        rows.append(row)
        with log.open("a") as f:
            f.write(json.dumps({**header, **row}) + "\n")
        print(json.dumps(row), flush=True)

    def room(need: float) -> bool:
        return time.monotonic() - began + need < args.deadline

    def attempt(stage: str, fn) -> dict | None:
        try:
            values = fn()
        except Exception as e:  # a stage's failure is a result: recorded whole, the next stage runs
            traceback.print_exc()
            record(stage, error=f"{type(e).__name__}: {e}"[:4000])
            return None
        record(stage, **values)
        return values

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "ceilings" in stages:
            attempt("ceilings", lambda: ceilings(device))
        seq = args.seq_len
        micros = [int(m) for m in args.small_micro.split(",")]
        if "chunk" in stages:
            dim = build_gpt_config(ModelConfig(preset=args.small), VOCAB, seq).d_model
            chunks = attempt("fused loss chunk", lambda: loss_chunks(device, micros[0] * seq, dim))
            if chunks and args.loss_chunk == "best":
                use_loss_chunk(chunks["best_compiled"])
        if args.loss_chunk.isdigit():
            use_loss_chunk(int(args.loss_chunk))
        chunk = fused_loss.default_chunk_size(VOCAB, device.type)
        data = random_tokens(tmp / "random.bin", VOCAB, 8_000_000, seq)
        for micro in micros:
            small = config(tmp / f"small-{micro}", device, args.small, "bf16", args.steps, micro, seq)
            if "small" in stages and room(90):
                attempt(f"kiln {args.small} bf16 micro {micro} chunk {chunk}", partial(kiln_run, small, data, after))
        if "profile" in stages and room(90):
            window = f"{after + 5}:{after + 7}"
            cfg = config(
                tmp / "profile",
                device,
                args.small,
                "bf16",
                after + 8,
                micros[0],
                seq,
                **{"profile.steps": window, "profile.dir": tmp / "profile-out"},
            )
            attempt(
                f"profile {args.small} bf16 micro {micros[0]} chunk {chunk}",
                partial(profiled, cfg, data, after, args.out),
            )
        small = config(tmp / "hand", device, args.small, "bf16", args.steps, micros[0], seq)
        if "hand" in stages and room(60):
            attempt(f"hand-written {args.small} bf16", lambda: {"tokens_per_s": hand_written(small, data, after)})
        for precision, stage in (("fp8", "fp8"), ("bf16", "large")):
            if stage in stages and room(150):
                cfg = config(tmp / stage, device, args.large, precision, args.steps, args.large_micro, seq)
                attempt(f"kiln {args.large} {precision} micro {args.large_micro}", partial(kiln_run, cfg, data, after))
        if "loss" in stages:
            text = text_tokens(tmp / "text.bin", seq)
            for precision in ("bf16", "fp8"):
                if not room(200):
                    break
                over = {"train.lr": 3e-4, "train.warmup_steps": 30}
                cfg = config(
                    tmp / f"loss-{precision}",
                    device,
                    args.large,
                    precision,
                    args.loss_steps,
                    args.large_micro,
                    seq,
                    **over,
                )
                out = kiln_run(cfg, text, after)
                shutil.copy(Path(cfg.run.dir) / "metrics.jsonl", args.out / f"loss-{precision}.metrics.jsonl")
                record(
                    f"loss {args.large} {precision}, {args.loss_steps} steps",
                    loss=out["loss"],
                    loss_last_tenth=out["loss_last_tenth"],
                    tokens_per_s=out["tokens_per_s"],
                )
    print("\n| stage | tokens/s | MFU (datasheet) | peak GiB | plan GiB | loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [
            r.get(k) for k in ("tokens_per_s", "mfu_datasheet", "peak_allocated_gib", "plan_allocated_gib", "loss")
        ]
        print(f"| {r['stage']} | " + " | ".join("" if c is None else f"{c:,.3f}" for c in cells) + " |")
    if rows and rows[0]["stage"] == "ceilings":
        print(json.dumps(rows[0]))


if __name__ == "__main__":
    main()
