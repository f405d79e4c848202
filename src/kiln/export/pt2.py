"""``--format pt2``: the model as a ``torch.export`` program (``model.pt2``, loaded with
``torch.export.load``) and compiled ahead of time by AOTInductor (``model.aoti.pt2``, loaded with
``torch._inductor.aoti_load_package``): token ids [B, T] in, logits out, with the batch and the
sequence length dynamic. The AOTInductor package runs without kiln or the model's Python code,
which is what TorchScript was once used for.

``--quantize int8``: the linear layers get int8 weights and dynamically quantized int8
activations (``torchao``'s ``Int8DynamicActivationInt8WeightConfig``), and the embedding int8
weights (a tied embedding shares the output layer's int8 matrix, so it is stored once).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from kiln.compat import quiet_library_imports
from kiln.export.check import AsLogits, Logits

PROGRAM = "model.pt2"
PACKAGE = "model.aoti.pt2"


def export_program(model: nn.Module, example: torch.Tensor, max_len: int) -> torch.export.ExportedProgram:
    """``model`` (token ids -> logits) exported with dynamic batch and sequence dimensions."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=max_len)
    with torch.no_grad():
        program = torch.export.export(AsLogits(model).eval(), (example,), dynamic_shapes=({0: batch, 1: seq},))
    for node in program.graph.nodes:
        # Where each op was traced in kiln's source: a third of a small model's file, and paths of
        # the machine that exported it, of no use where the program runs.
        node.meta.pop("stack_trace", None)
    return program


def write_pt2(model: nn.Module, example: torch.Tensor, max_len: int, out: Path) -> dict[str, Logits]:
    """Write the exported program and its AOTInductor package to ``out``; each loaded back from
    its file, to be checked."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    program = export_program(model, example, max_len)
    torch.export.save(program, out / PROGRAM)
    aoti_compile_and_package(program, package_path=str(out / PACKAGE))
    return {"pt2": torch.export.load(out / PROGRAM).module(), "aoti": aoti_load_package(str(out / PACKAGE))}


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with int8 linear layers (dynamic int8 activations) and int8 embeddings."""
    quiet_library_imports()
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerAxis
    except ImportError:
        raise ImportError("int8 for PyTorch needs torchao: pip install 'kiln[export]'") from None
    model = copy.deepcopy(model).eval()
    # Tied input and output matrices are found before quantizing replaces the output one.
    tied = [
        (emb, lin)
        for emb in model.modules()
        if isinstance(emb, nn.Embedding)
        for lin in model.modules()
        if isinstance(lin, nn.Linear) and lin.weight is emb.weight
    ]
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    shared = {id(emb) for emb, _ in tied}
    quantize_(
        model,
        IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
        filter_fn=lambda module, _: isinstance(module, nn.Embedding) and id(module) not in shared,
    )
    for emb, lin in tied:
        _look_up_in(emb, lin)
    return model


def _look_up_in(emb: nn.Embedding, output: nn.Linear) -> None:
    """Make the tied embedding ``emb`` look its tokens up in ``output``'s int8 matrix (one row per
    token) without holding it: torch.export.save shares storage between names only for plain
    tensors, so a quantized matrix held under two names would be written twice. The embedding
    becomes a subclass of its own class whose ``weight`` reads the output layer's (which
    torch.export traces through), so its forward, a scaled embedding's too, runs as before."""

    class TiedEmbedding(type(emb)):  # type: ignore[misc]
        weight = property(lambda self: output.weight)

    delattr(emb, "weight")
    emb.__class__ = TiedEmbedding
