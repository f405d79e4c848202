"""Activation memory per rank under tensor parallelism, with kiln's sequence and loss parallelism
against plain Megatron-style tensor parallelism (projections split, everything between them and
the output layer whole on every rank): one sequence's forward and backward on 2 gloo ranks,
without activation checkpointing, with the selective (op-level) one and with the full one.

    python bench/tp_memory.py [--tp 2] [--seq-len 1024] [--preset small] [--vocab 4096] [--steps 3]

"kept for backward": the bytes the forward pass leaves allocated for the backward pass (the C
heap in use after the forward, less before it: ``common.allocated_bytes``), of the rank that
keeps the most: the saved tensors, and under checkpointing the blocks' inputs the checkpoints
hold. "largest product": the largest output of a matrix product a rank computes in the step
(from the profiler's recorded input shapes), which is the output layer's: [tokens, vocabulary /
tp] chunks under loss parallelism, [tokens, vocabulary] chunks without, against the whole
[tokens, vocabulary] logits. Every rank runs in a fresh process on one thread; "plain" is kiln's
GPT plan with its sequence parallel styles, vocabulary-parallel embedding, output layer and loss
taken out.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.distributed.parallel import apply_tp
from kiln.models.gpt import FAMILY
from kiln.models.gpt.model import GPT, GPTConfig
from kiln.models.gpt.presets import PRESETS
from kiln.train.apply import apply_activation_checkpointing

from common import allocated_bytes

MiB = 1 << 20
CHECKPOINTING = ("none", "selective", "full")


def plain_styles(block: torch.nn.Module) -> dict:
    """Megatron's split without sequence parallelism: the block's input whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {name: ColwiseParallel() for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")}
    return {**styles, "attn.wo": RowwiseParallel(), "mlp.w2": RowwiseParallel()}


def rank_main(rank: int, mode: str, checkpointing: str, args: argparse.Namespace, init: str, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.tp)
    torch.manual_seed(0)
    cfg = GPTConfig(**{**PRESETS[args.preset], "vocab_size": args.vocab, "max_seq_len": args.seq_len})
    model = GPT(cfg)
    plan = FAMILY.parallel_plan(cfg)
    if mode == "plain":
        plan = dataclasses.replace(plan, tensor_parallel=plain_styles, tp_root=None, loss="", sequence_parallel=False)
    apply_tp(model, plan, init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",)))
    if checkpointing != "none":
        apply_activation_checkpointing(model, plan, selective=checkpointing == "selective")
    tokens = torch.randint(0, args.vocab, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    idx, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> tuple[float, int]:
        before = allocated_bytes()
        loss = model(idx, targets)
        kept = allocated_bytes() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item(), kept

    step()  # warm-up
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        loss, _ = step()
    largest = 0
    for event in prof.events():
        matrices = [shape for shape in event.input_shapes or () if len(shape) == 2]
        if event.name in ("aten::mm", "aten::addmm") and len(matrices) >= 2:
            a, b = matrices[-2:]  # addmm's bias first
            largest = max(largest, a[0] * b[1])
    times, kept = [], []
    for _ in range(args.steps):
        began = time.perf_counter()
        kept.append(step()[1])
        times.append(time.perf_counter() - began)
    row = {"loss": loss, "kept": statistics.median(kept), "largest": largest, "s": statistics.median(times)}
    rows = [None] * args.tp
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    if rank == 0:
        results.put(max(rows, key=lambda r: r["kept"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    names = {"plain": "plain (no SP, whole output layer)", "kiln": "kiln (SP + vocabulary and loss parallel)"}
    logits = args.seq_len * args.vocab
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread a rank, gloo")
    print(f"command: python {' '.join(sys.argv)}\n")
    print(f"| activation checkpointing | tp = {args.tp} | kept for backward a rank | / plain "
          "| largest product (elements) | / [tokens, vocab] | s / step | loss |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for checkpointing in CHECKPOINTING:
        rows = {}
        for mode in names:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(rank_main, args=(mode, checkpointing, args, f"{tmp}/init", results), nprocs=args.tp, join=True)
            rows[mode] = r = results.get()
            ratio = r["kept"] / rows["plain"]["kept"]
            print(
                f"| {checkpointing} | {names[mode]} | {r['kept'] / MiB:.1f} MiB | {ratio:.2f} "
                f"| {r['largest']:,} | {r['largest'] / logits:.3f} | {r['s']:.2f} | {r['loss']:.6f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
