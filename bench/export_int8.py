"""CPU latency per token and size on disk of kiln's export artifacts, float against int8.

For a GPT of the given size (random weights: latency and size do not depend on their values;
accuracy is measured by ``kiln export`` itself on trained runs), every artifact is written with
kiln's own export functions and timed with the function that fills export.json: the median of
batch-1 forwards over one sequence, divided by its length.

    python bench/export_int8.py                       # d_model 512, 8 layers, vocab 8192, 256 tokens
    python bench/export_int8.py --skip-aoti --formats onnx
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from kiln.export.check import latency_per_token
from kiln.export.pt2 import PACKAGE, PROGRAM, export_program, quantize_int8
from kiln.models import GPT, GPTConfig


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def bench_pt2(model, example, ids, seq, out: Path, aoti: bool) -> dict:
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    rows = {}
    for name, m in (("float", model), ("int8", quantize_int8(model))):
        program = export_program(m, example, seq)
        torch.export.save(program, out / f"{name}-{PROGRAM}")
        rows[f"pt2 {name} (program)"] = (latency_per_token(program.module(), ids), size(out / f"{name}-{PROGRAM}"))
        if aoti:
            aoti_compile_and_package(program, package_path=str(out / f"{name}-{PACKAGE}"))
            package = aoti_load_package(str(out / f"{name}-{PACKAGE}"))
            rows[f"pt2 {name} (AOTInductor)"] = (latency_per_token(package, ids), size(out / f"{name}-{PACKAGE}"))
    return rows


def bench_onnx(model, example, ids, vocab, out: Path) -> dict:
    from kiln.export.onnx import OnnxModel, export_onnx, quantize_onnx_dynamic, quantize_onnx_static

    fp32, dynamic, static = out / "fp32.onnx", out / "dynamic.onnx", out / "static.onnx"
    export_onnx(model, example, fp32)
    quantize_onnx_dynamic(fp32, dynamic)
    rng = np.random.default_rng(1)
    quantize_onnx_static(fp32, static, [rng.integers(0, vocab, (1, ids.size(1))) for _ in range(8)])
    return {
        f"onnx {name}": (latency_per_token(OnnxModel(path).logits, ids), size(path))
        for name, path in (("fp32", fp32), ("int8 dynamic", dynamic), ("int8 static QDQ", static))
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--formats", default="pt2,onnx")
    p.add_argument("--skip-aoti", action="store_true", help="time the exported programs only (no compile)")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=a.vocab,
        n_layer=a.layers,
        d_model=a.d_model,
        n_head=a.d_model // 64,
        n_kv_head=max(1, a.d_model // 128),
        d_ff=3 * a.d_model,
        max_seq_len=a.seq,
        tie_embeddings=True,
    )
    model = GPT(cfg).eval()
    example = torch.randint(0, a.vocab, (2, a.seq // 2))
    ids = torch.randint(0, a.vocab, (1, a.seq))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if "pt2" in a.formats:
            rows.update(bench_pt2(model, example, ids, a.seq, out, not a.skip_aoti))
        if "onnx" in a.formats:
            rows.update(bench_onnx(model, example, ids, a.vocab, out))
    print(f"GPT {model.num_params():,} parameters, {a.seq} tokens, {torch.get_num_threads()} threads")
    print(f"{'artifact':<28} {'ms/token':>9} {'MB':>8}")
    for name, (latency, nbytes) in rows.items():
        print(f"{name:<28} {latency * 1e3:>9.3f} {nbytes / 1e6:>8.1f}")
    print(json.dumps({name: {"s_per_token": lat, "bytes": n} for name, (lat, n) in rows.items()}))


if __name__ == "__main__":
    main()
