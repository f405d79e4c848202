"""Activation memory per rank under context parallelism: one long sequence's forward and backward
at cp = 1 (the plain GPT in one process) against cp = 2, 4 (``apply_cp``, that many gloo processes).

    python bench/cp_memory.py [--cp 1 2 4] [--seq-len 4096] [--d-model 256] [--layers 4] [--steps 3]

Context parallelism exists to fit sequences whose activations do not fit one device, so the
figure is what each rank keeps for backward: the bytes of the tensors saved during the forward,
counted through ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; the model's
parameters and buffers are state, not activations, and are left out). Beside it, the growth of the
process's peak resident set over that step (allocator and gloo buffers included, so noisier), and
the median seconds of ``--steps`` forward+backward passes. Every rank runs in a fresh process on
one thread (``torch.set_num_threads(1)``), after a warm-up step on a short sequence that starts the
lazy parts (kernels, gloo) without raising the peak; the table shows the rank that saved the most.
The model is a GPT of 8 heads and 2 key/value heads (by default 4 layers, d_model 256, SwiGLU 768),
vocabulary 4096, tied, fp32, batch 1, given targets (the fused loss never holds the whole logits).
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.distributed.context import apply_cp
from kiln.models.gpt.model import GPT, GPTConfig

from common import SavedTensors

MiB = 1 << 20


def attention_bytes(loss: torch.Tensor) -> int:
    """Bytes of the keys, values and masks that the attention nodes of ``loss``'s graph saved,
    which context parallelism does not divide by cp (the keys and values are the whole sequence's)."""
    held, todo, done = {}, [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in done:
            continue
        done.add(node)
        if node.name().startswith("ScaledDotProduct"):
            for name in ("_saved_key", "_saved_value", "_saved_attn_mask"):
                t = getattr(node, name, None)
                if isinstance(t, torch.Tensor):
                    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        todo.extend(f for f, _ in node.next_functions)
    return sum(held.values())


def rank_main(rank: int, cp: int, args: argparse.Namespace, init: str, results) -> None:
    torch.set_num_threads(1)
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=cp)
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=4096, n_layer=args.layers, d_model=args.d_model, n_head=8, n_kv_head=2,
        d_ff=3 * args.d_model, max_seq_len=args.seq_len, tie_embeddings=True,
    )  # fmt: skip
    model = GPT(cfg)
    if cp > 1:
        cp_mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))["cp"]
        apply_cp(list(model.blocks), "attn.core", cp_mesh).install(model)
    tokens = torch.randint(0, 4096, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    idx, targets = tokens[:, :-1], tokens[:, 1:]

    def step(length: int = args.seq_len) -> tuple[float, int]:
        """One forward and backward; the loss and what attention saved."""
        loss = model(idx[:, :length], targets[:, :length])
        attention = attention_bytes(loss)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item(), attention

    step(8 * cp)  # starts the kernels and gloo on a sequence too short to raise the peak
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    saved = SavedTensors(model)
    with saved:
        loss, attention = step()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # ru_maxrss: KiB on Linux
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    row = {"loss": loss, "saved": sum(saved.storages.values()), "attention": attention, "rss": grown}
    row["s"] = statistics.median(times)
    if cp > 1:
        rows = [None] * cp
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
        if rank:
            return
        row = max(rows, key=lambda r: r["saved"])
    results.put(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    rows = {}
    for cp in args.cp:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(rank_main, args=(cp, args, f"{tmp}/init", results), nprocs=cp, join=True)
        rows[cp] = results.get()
    base = rows.get(1, rows[args.cp[0]])
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread a rank, gloo")
    print(f"command: python {' '.join(sys.argv)}\n")
    print("| cp | ranks | saved activations a rank | / cp=1 | of which attention's keys, values, mask "
          "| peak RSS growth | s / step | loss |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cp, r in rows.items():
        print(
            f"| {cp} | {cp} | {r['saved'] / MiB:.1f} MiB | {r['saved'] / base['saved']:.2f} "
            f"| {r['attention'] / MiB:.1f} MiB | {r['rss'] / MiB:.0f} MiB | {r['s']:.2f} | {r['loss']:.7f} |"
        )
    # The same sequence and weights: the split loss is the whole one, up to the order of the sums.
    print("\nloss: " + ", ".join(f"cp={cp} {r['loss']!r}" for cp, r in rows.items()))


if __name__ == "__main__":
    main()
