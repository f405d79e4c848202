"""``kiln export RUN --format onnx``: a model that maps token ids [B, T] to logits, as an ONNX file
ONNX Runtime runs, and its int8 versions quantized by ONNX Runtime.

Export goes through ``torch.export`` (``torch.onnx.export(dynamo=True)``) only: a model it cannot
capture is an error naming the architecture and the reason, never a TorchScript trace. Each file is
written whole or not at all: it is made in a staging directory beside its destination (under its
final name, which an external data file records) and moved into place when complete.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln.export.check import AsLogits, ExportError

INPUT, OUTPUT = "input_ids", "logits"
# Above this many bytes of weights, they go to one ``<name>.data`` file beside the graph: protobuf
# cannot hold 2 GiB, and this stays below the exporter's own threshold so the rule is ours.
EXTERNAL_DATA_BYTES = 1 << 30


def _onnx_modules():
    """onnx, onnxruntime and onnxscript, or an ImportError saying how to install them."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (the dynamo exporter's translation library)
    except ImportError as e:
        raise ImportError(f"ONNX needs onnx, onnxruntime and onnxscript ({e}): pip install 'kiln[export]'") from e
    return onnx, onnxruntime


class OnnxExportError(ExportError):
    """The model cannot be captured by ``torch.export`` or translated to ONNX."""


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost cause: the exporter wraps the reason in generic advice."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def export_onnx(
    model: nn.Module,
    example_ids: torch.Tensor,
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    name: str | None = None,
) -> None:
    """Write ``model``'s logits for token ids as ONNX at ``path`` (input ``input_ids`` [batch,
    sequence] int64, output ``logits``), batch and sequence sizes free up to the model's maximum
    length ``limit`` (None: any); weights over EXTERNAL_DATA_BYTES go to ``<path>.data``.
    ``example_ids`` is only traced; ``name``: the architecture, as errors call it (by default the
    model's class)."""
    name = name or type(model).__name__
    onnx, _ = _onnx_modules()
    from torch.export import Dim

    path = Path(path)
    wrapper = AsLogits(model)
    # Example sizes of 1 would be specialized by torch.export (a size-1 dimension broadcasts),
    # so the traced example has at least two rows and two positions.
    example = example_ids.to(torch.long).repeat(2, 2)[: max(2, example_ids.size(0)), : max(2, example_ids.size(1))]
    if limit is not None:
        example = example[:, :limit]
    dims = {0: Dim("batch", min=1), 1: Dim("sequence", min=1, max=limit) if limit else Dim("sequence", min=1)}
    was_training = model.training
    wrapper.eval()
    # The exporter's registry logs a warning for every torchvision op it cannot find, which has
    # nothing to do with a language model.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(
            wrapper,
            (example,),
            dynamo=True,
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_shapes={INPUT: dims},
            verbose=False,
        )
    except Exception as e:
        raise OnnxExportError(
            f"{name}: torch.onnx.export (dynamo=True, torch {torch.__version__}) cannot export it: {_root_cause(e)}"
        ) from e
    finally:
        model.train(was_training)
    assert program is not None  # dynamo=True returns the program
    weights = sum(v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)
    with _staged(path) as staged:
        program.save(staged, external_data=weights > EXTERNAL_DATA_BYTES)
        # The path form reads external data and has no 2 GiB limit.
        onnx.checker.check_model(str(staged), full_check=True)


@contextlib.contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """A path with ``path``'s name in a new directory beside it; what is written there (the graph
    and its ``.data`` file, if any) replaces ``path`` when the block ends without an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        staged = staging / path.name
        yield staged
        data, placed_data = staged.with_name(staged.name + ".data"), path.with_name(path.name + ".data")
        # The data first: a graph in place always finds the weights it names.
        if data.exists():
            os.replace(data, placed_data)
            os.replace(staged, path)
        else:
            os.replace(staged, path)
            placed_data.unlink(missing_ok=True)  # a bigger model's, exported here before
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class OnnxModel:
    """An exported model in an ONNX Runtime session: ``logits(ids)`` as a NumPy array."""

    def __init__(
        self, path: str | os.PathLike, providers: Sequence[str] | None = None, threads: int | None = None
    ) -> None:
        """``providers``: ONNX Runtime execution providers to try in order (those this build has;
        the CPU one is always last); ``threads``: intra-op threads (ONNX Runtime's default: all cores)."""
        _, ort = _onnx_modules()
        available = ort.get_available_providers()
        chosen = [p for p in providers or () if p in available and p != "CPUExecutionProvider"]
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=[*chosen, "CPUExecutionProvider"])

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def logits(self, ids: np.ndarray | torch.Tensor) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu().numpy()
        return self.session.run([OUTPUT], {INPUT: np.asarray(ids, dtype=np.int64)})[0]


def _uses_external_data(path: Path) -> bool:
    onnx, _ = _onnx_modules()
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    return any(uses_external_data(t) for t in model.graph.initializer)


def _prepared(src: Path, out: Path, external: bool) -> Path:
    """``src`` after ONNX Runtime's pre-quantization pass (shape inference, constant folding).

    The folding matters for tied embeddings: the output layer multiplies by ``Transpose(table)``,
    which only becomes a constant (and so a quantizable weight) here. Symbolic shape inference is
    skipped: it cannot follow RoPE's position slices (and when it fails it leaves files in the working
    directory); ONNX's own inference suffices.
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(
        src,
        out,
        skip_symbolic_shape=True,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        external_data_location=out.name + ".data",
    )
    return out


def _weight_nodes(path: Path) -> list[str]:
    """The MatMul nodes whose right operand is a weight and the Gather nodes that look up a weight
    table (embeddings): the nodes int8 weights shrink."""
    onnx, _ = _onnx_modules()
    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer if len(t.dims) == 2}
    nodes = [
        n.name
        for n in graph.node
        if (n.op_type == "MatMul" and n.input[1] in weights) or (n.op_type == "Gather" and n.input[0] in weights)
    ]
    if not nodes:  # ONNX Runtime reads an empty list as "every node"
        raise ValueError(f"{path}: no matrix product or embedding lookup with a weight to quantize")
    return nodes


def quantize_onnx_dynamic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """int8 weights (QInt8, per tensor) for the matrix products and embedding tables of ONNX model
    ``src``; activations are quantized at run time, batch by batch. ``dst`` keeps ``src``'s layout
    (one file, or the graph and one ``.data`` file)."""
    _onnx_modules()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = Path(src), Path(dst)
    external = _uses_external_data(src)
    with _staged(dst) as staged:
        prepared = _prepared(src, staged.with_name("prepared.onnx"), external)
        quantize_dynamic(
            prepared,
            staged,
            op_types_to_quantize=["MatMul", "Gather"],
            nodes_to_quantize=_weight_nodes(prepared),
            weight_type=QuantType.QInt8,
            use_external_data_format=external,
        )


def quantize_onnx_static(src: str | os.PathLike, dst: str | os.PathLike, calibration: Iterable[np.ndarray]) -> None:
    """int8 weights (QInt8) and activations (QUInt8, their ranges the min and max seen on the
    ``calibration`` batches of token ids) for the weight matrix products and embedding tables of
    ONNX model ``src``, in QDQ form; ``dst`` keeps ``src``'s layout."""
    _onnx_modules()
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Batches(CalibrationDataReader):
        """Token id batches as calibration feeds; a 1-D array is one sequence."""

        def __init__(self, batches: Iterator[np.ndarray]):
            self.batches = batches

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else {INPUT: np.atleast_2d(np.asarray(batch, dtype=np.int64))}

    src, dst = Path(src), Path(dst)
    batches = iter(calibration)
    first = next(batches, None)
    if first is None:
        raise ValueError("static quantization needs at least one calibration batch")
    external = _uses_external_data(src)
    with _staged(dst) as staged:
        prepared = _prepared(src, staged.with_name("prepared.onnx"), external)
        quantize_static(
            prepared,
            staged,
            Batches(itertools.chain([first], batches)),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul", "Gather"],
            nodes_to_quantize=_weight_nodes(prepared),
            # Unsigned activations with signed weights: the fast int8 product on x86 (VNNI).
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            use_external_data_format=external,
            # A float product (no Q/DQ pair after it) lets ONNX Runtime fuse each into one
            # MatMulIntegerToFloat, as in dynamic quantization, instead of requantizing.
            extra_options={"OpTypesToExcludeOutputQuantization": ["MatMul"]},
        )
