"""ONNX export through torch.export, checked in ONNX Runtime: logits match PyTorch's at any batch
size and sequence length, and ONNX Runtime's int8 files are at most 35% of the float file with
validation perplexity within 5% of the PyTorch model's."""

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.cli import main
from kiln.data import prepare
from kiln.export.onnx import (
    OnnxExportError,
    OnnxModel,
    export_onnx,
    quantize_onnx_dynamic,
    quantize_onnx_static,
)
from kiln.models.hf import CausalLM, SequenceClassifier
from kiln.train.run import load_run

from conftest import tiny_gpt, tiny_overrides

pytestmark = pytest.mark.e2e

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")


def _train(run, corpus, **extra):
    sets = tiny_overrides(run, corpus, checkpoint__every=0, **extra)
    # Threads of a model this small wait on each other at every op; on shared cores one thread
    # trains it many times faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
    finally:
        torch.set_num_threads(threads)
    return load_run(run, device="cpu")


def _val_rows(run):
    """The run's validation tokens as consecutive rows of seq_len + 1 (inputs and their targets)."""
    tokens = prepare(run.cfg.data, progress=False).tokens("val")
    width = run.cfg.data.seq_len + 1
    return np.stack([tokens[i : i + width] for i in range(0, len(tokens) - width, width - 1)]).astype(np.int64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    """A GPT (tied embeddings, grouped-query attention) trained until its logits mean something,
    its ONNX export and real validation sequences (seq_len + 1 tokens: inputs and targets)."""
    run = _train(tmp_path_factory.mktemp("tied") / "run", corpus_dir, train__max_steps=300, eval__sample_tokens=0)
    assert run.model.config.tie_embeddings and run.model.config.n_kv_head < run.model.config.n_head
    rows = _val_rows(run)
    path = tmp_path_factory.mktemp("tied-onnx") / "model.onnx"
    export_onnx(run.model, torch.from_numpy(rows[:2, :-1]), path, limit=run.family.context_length(run.args))
    return run, path, rows


@pytest.fixture(scope="module")
def untied(tmp_path_factory, corpus_dir):
    return _train(
        tmp_path_factory.mktemp("untied") / "run",
        corpus_dir,
        train__max_steps=40,
        eval__sample_tokens=0,
        model__tie_embeddings="false",
    )


def _logits_match(model, path, rows, shapes):
    # Where this ONNX Runtime build has no CUDA, the session runs on the CPU alone.
    session = OnnxModel(path, providers=["CUDAExecutionProvider"])
    assert session.providers[-1] == "CPUExecutionProvider"
    for batch, length in shapes:
        ids = torch.from_numpy(rows[:batch, :length])
        with torch.no_grad():
            expected = model(ids).numpy()
        got = session.logits(ids)
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-4, (batch, length)


def _perplexity(logits_fn, rows, batch=32):
    """exp of the mean next-token cross-entropy over ``rows``."""
    losses = []
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        logits = torch.as_tensor(np.asarray(logits_fn(chunk[:, :-1])))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), torch.from_numpy(chunk[:, 1:]).flatten()))
    return float(torch.exp(torch.stack(losses).mean()))


def _torch_logits(model):
    def logits(ids):
        with torch.no_grad():
            return model(torch.from_numpy(ids))

    return logits


@pytest.mark.slow
def test_tied_gpt_runs_in_onnx_runtime_at_any_batch_and_length(trained):
    run, path, rows = trained
    seq_len = run.cfg.data.seq_len
    _logits_match(run.model, path, rows, [(2, seq_len), (3, seq_len // 2), (1, 1)])


@pytest.mark.slow
def test_untied_gpt_runs_in_onnx_runtime(untied, tmp_path):
    rows, seq_len = _val_rows(untied), untied.cfg.data.seq_len
    assert not untied.model.config.tie_embeddings
    limit = untied.family.context_length(untied.args)
    export_onnx(untied.model, torch.from_numpy(rows[:1, :5]), tmp_path / "model.onnx", limit=limit)
    _logits_match(untied.model, tmp_path / "model.onnx", rows, [(2, seq_len), (3, seq_len // 2)])


@pytest.mark.slow
def test_the_export_is_torch_exports_not_a_torchscript_trace(trained):
    _, path, _ = trained
    model = onnx.load(path)
    assert model.producer_name == "pytorch"
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 18
    (input_ids,) = model.graph.input
    assert input_ids.name == "input_ids" and [o.name for o in model.graph.output] == ["logits"]
    # Only the torch.export-based exporter records the exported program's signature on inputs.
    assert any(p.key.startswith("pkg.torch.export.graph_signature") for p in input_ids.metadata_props)
    assert [d.dim_param for d in input_ids.type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert not list(path.parent.glob("*.data")) and not list(path.parent.glob(".*"))  # one file, no leftovers


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_int8_is_at_most_35_percent_of_the_size_within_5_percent_perplexity(trained, method, tmp_path):
    run, path, rows = trained
    measured, calibration = rows[:256], rows[256:320]
    out = tmp_path / "int8.onnx"
    if method == "dynamic":
        quantize_onnx_dynamic(path, out)
    else:
        quantize_onnx_static(path, out, (calibration[i : i + 8, :-1] for i in range(0, len(calibration), 8)))
    assert out.stat().st_size <= 0.35 * path.stat().st_size
    reference = _perplexity(_torch_logits(run.model), measured)
    assert _perplexity(OnnxModel(path).logits, measured) == pytest.approx(reference, rel=1e-4)
    quantized = _perplexity(OnnxModel(out).logits, measured)
    assert abs(quantized / reference - 1) <= 0.05, (quantized, reference)
    assert not list(tmp_path.glob(".*"))  # no staging directory left behind


@pytest.mark.slow
def test_a_failed_quantization_keeps_what_was_there(trained, tmp_path):
    _, path, rows = trained
    out = tmp_path / "int8.onnx"
    out.write_text("mine")

    def calibration():
        yield rows[:4, :-1]
        raise RuntimeError("the data went away")

    with pytest.raises(RuntimeError, match="the data went away"):
        quantize_onnx_static(path, out, calibration())
    assert out.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["int8.onnx"]


@pytest.mark.slow
def test_weights_over_the_limit_go_to_one_data_file(tmp_path, monkeypatch):
    monkeypatch.setattr("kiln.export.onnx.EXTERNAL_DATA_BYTES", 0)
    model = tiny_gpt().eval()
    rows = torch.randint(0, model.config.vocab_size, (3, 16)).numpy()
    export_onnx(model, torch.from_numpy(rows[:2]), tmp_path / "model.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    onnx.checker.check_model(str(tmp_path / "model.onnx"), full_check=True)
    _logits_match(model, tmp_path / "model.onnx", rows, [(2, 16), (3, 5)])
    quantize_onnx_dynamic(tmp_path / "model.onnx", tmp_path / "int8.onnx")
    assert (tmp_path / "int8.onnx.data").is_file()
    assert OnnxModel(tmp_path / "int8.onnx").logits(rows).shape == (3, 16, model.config.vocab_size)


def _hf(kind, directory):
    cls, wrapper = {
        "bert": (transformers.BertForSequenceClassification, SequenceClassifier),
        "llama": (transformers.LlamaForCausalLM, CausalLM),
    }[kind]
    return wrapper(cls.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_hugging_face_wrappers_export(kind, request, tmp_path):
    model = _hf(kind, request.getfixturevalue(f"hf_{kind}"))
    rows = torch.randint(0, model.hf.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0)).numpy()
    export_onnx(model, torch.from_numpy(rows[:2, :8]), tmp_path / "model.onnx")
    _logits_match(model, tmp_path / "model.onnx", rows, [(2, 24), (3, 5)])


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)

    def forward(self, ids):
        x = self.emb(ids)
        return x * 2 if x.sum() > 0 else x


def test_a_model_torch_export_cannot_capture_is_an_error_naming_it_and_why(tmp_path):
    with pytest.raises(OnnxExportError, match=r"_DataDependent: .*dynamo=True.*data-dependent"):
        export_onnx(_DataDependent(), torch.zeros(2, 3, dtype=torch.long), tmp_path / "model.onnx")
    assert not list(tmp_path.iterdir())


def test_without_onnx_runtime_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r"pip install 'kiln\[export\]'"):
        export_onnx(tiny_gpt(), torch.zeros(2, 3, dtype=torch.long), tmp_path / "model.onnx")
