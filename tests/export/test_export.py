"""kiln export --format safetensors | pt2: every artifact computes the trained model's logits, the
AOTInductor package runs in a process that never imports kiln, int8 keeps perplexity, bad input
writes nothing."""

import json
import subprocess
import sys

import pytest
import torch

from kiln.cli import main
from kiln.train.run import load_run

from conftest import tiny_overrides, write_jsonl
from hf_models import learnable_classes

pytestmark = pytest.mark.e2e


def train(run, corpus, *more, **extra):
    sets = tiny_overrides(run, corpus, **{"train.max_steps": 8, "eval.sample_tokens": 0, **extra})
    assert main(["train", *[a for item in [*sets, *more] for a in ("--set", item)]]) == 0
    return run


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_dir):
    return train(tmp_path_factory.mktemp("gpt") / "run", corpus_dir)


def export_info(out):
    return json.loads((out / "export.json").read_text())


def test_safetensors_is_loaded_by_generate_and_eval_like_the_run(gpt_run, tmp_path, capsys):
    out = tmp_path / "weights"
    assert main(["export", str(gpt_run), "--format", "safetensors", "--out", str(out)]) == 0
    info = export_info(out)
    assert info["safetensors"]["max_abs_diff"] == 0 and info["step"] == 8
    assert {"model.safetensors", "config.toml", "model.json", "tokenizer.json"} <= set(info["files"])
    checkpoint = max((gpt_run / "checkpoints").iterdir())
    assert (out / "model.safetensors").stat().st_size < sum(p.stat().st_size for p in checkpoint.rglob("*"))

    capsys.readouterr()
    for source in (gpt_run, out):
        assert main(["generate", str(source), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "12"]) == 0
    from_run, from_export = capsys.readouterr().out.split("def ", 2)[1:]
    assert from_run == from_export
    for source in (gpt_run, out):
        assert main(["eval", str(source)]) == 0
    from_run, from_export = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines())
    assert from_run["val_loss"] == from_export["val_loss"] and from_run["step"] == from_export["step"]


def test_a_checkpoint_directory_is_a_source_too(gpt_run, tmp_path):
    first = sorted((gpt_run / "checkpoints").iterdir())[0]
    out = tmp_path / "early"
    assert main(["export", str(first), "--format", "safetensors", "--out", str(out)]) == 0
    assert export_info(out)["step"] == 4
    early = load_run(first.parent.parent, checkpoint=first, device="cpu").model.state_dict()
    exported = load_run(out, device="cpu").model.state_dict()
    assert all(torch.equal(early[k], exported[k]) for k in early)


RUN_PACKAGE = """
import sys, torch
package = torch._inductor.aoti_load_package(sys.argv[1] + "/model.aoti.pt2")
program = torch.export.load(sys.argv[1] + "/model.pt2").module()
inputs = torch.load(sys.argv[2])
torch.save([(package(ids), program(ids)) for ids in inputs], sys.argv[3])
assert not any(name == "kiln" or name.startswith("kiln.") for name in sys.modules), "kiln was imported"
"""


@pytest.mark.slow
def test_pt2_program_and_aoti_package_run_without_kiln_at_any_batch_and_length(gpt_run, tmp_path):
    out = tmp_path / "pt2"
    assert main(["export", str(gpt_run), "--format", "pt2", "--out", str(out)]) == 0
    info = export_info(out)
    assert info["pt2"]["max_abs_diff"] <= 1e-5 and info["aoti"]["max_abs_diff"] <= 1e-5
    assert info["check"]["shapes"] == [[2, 32], [3, 16]]

    run = load_run(gpt_run, device="cpu")
    tokens = torch.randint(0, run.args.vocab_size, (5, 32))
    # Contiguous, as the package is compiled for (a strided view of a batch would be misread).
    inputs = [tokens[:1, :7].contiguous(), tokens[:, :32], tokens[:4, :20].contiguous()]
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "run_package.py"
    script.write_text(RUN_PACKAGE)
    # A fresh interpreter in another directory, given nothing of kiln's.
    subprocess.run(
        [sys.executable, str(script), str(out), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        check=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
    )
    with torch.no_grad():
        for ids, (package, program) in zip(inputs, torch.load(tmp_path / "outputs.pt"), strict=True):
            expected = run.model(ids)
            torch.testing.assert_close(package, expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(program, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_pt2_int8_is_smaller_and_keeps_perplexity(tmp_path_factory, corpus_dir):
    # Wide enough that weights, not the program's graph, make up the file; trained enough that
    # perplexity means something; one layer, since compiling each kind twice is the test's cost.
    run = train(
        tmp_path_factory.mktemp("wide") / "run",
        corpus_dir,
        "model.n_layer=1",
        "model.d_model=256",
        "model.d_ff=1536",
        **{"train.max_steps": 30, "train.lr": 3e-3},
    )
    out = run.parent / "int8"
    assert main(["export", str(run), "--format", "pt2", "--quantize", "int8", "--out", str(out)]) == 0
    q = export_info(out)["quantized"]
    assert q["size_ratio"] <= 0.35
    # The tied embedding reads the output layer's int8 matrix: the program stores it once.
    assert "model.tok_emb.weight" not in torch.export.load(out / "model.pt2").state_dict
    for kind in ("pt2", "aoti"):
        ppl = q[kind]["metric"]
        assert abs(ppl["int8"]["perplexity"] / ppl["float"]["perplexity"] - 1) <= 0.05
        assert q[kind]["latency_s_per_token"]["int8"] > 0 and q[kind]["speedup"] > 0


def test_int8_keeps_a_scaled_tied_embedding_reading_the_output_layers_matrix(tmp_path):
    """Gemma 3's embedding scales what it looks up: tied, after quantizing it holds no matrix of
    its own (the program stores the output layer's once) and still scales its rows."""
    from transformers import AutoModelForCausalLM

    from kiln.export.pt2 import quantize_int8

    from hf_models import save_tiny

    model = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "gemma", "gemma3_text", tokenizer=False)).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    quantized = quantize_int8(model)
    assert not list(quantized.get_input_embeddings().parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(ids).logits, quantized(ids).logits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # rows left unscaled: 13% off


def test_bad_input_is_one_line_and_writes_nothing(gpt_run, tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (["export", str(tmp_path / "nothing"), "--format", "safetensors"], "not a kiln run directory"),
        (["export", str(gpt_run), "--format", "hf", "--quantize", "int8"], "does not apply to --format hf"),
        (["export", str(gpt_run), "--format", "pt2", "--quantize", "int8-static"], "int8-static"),
    ]
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "checkpoints" / "step-00000004").mkdir(parents=True)
    for name in ("config.toml", "model.json", "tokenizer.json"):
        (partial / name).write_bytes((gpt_run / name).read_bytes())
    cases.append((["export", str(partial), "--format", "safetensors"], "no complete checkpoint"))
    cases.append((["export", str(partial / "checkpoints" / "step-00000004"), "--format", "pt2"], "step-00000004"))
    for argv, message in cases:
        assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists() and not list(tmp_path.glob(".out.*"))
    with pytest.raises(SystemExit):
        main(["export", str(gpt_run), "--format", "tflite", "--out", str(out)])


@pytest.mark.slow
def test_onnx_runs_in_onnx_runtime_and_int8_keeps_perplexity(gpt_run, tmp_path):
    out = tmp_path / "onnx"
    assert main(["export", str(gpt_run), "--format", "onnx", "--out", str(out)]) == 0
    info = export_info(out)
    assert info["onnx"]["max_abs_diff"] <= 1e-4 and info["check"]["shapes"] == [[2, 32], [3, 16]]
    for quantize in ("int8", "int8-static"):
        q_out = tmp_path / quantize
        assert main(["export", str(gpt_run), "--format", "onnx", "--quantize", quantize, "--out", str(q_out)]) == 0
        q = export_info(q_out)["quantized"]
        assert q["size_ratio"] <= 0.35 and q["bytes"] == (q_out / "model.onnx").stat().st_size
        ppl = q["onnx"]["metric"]
        assert abs(ppl["int8"]["perplexity"] / ppl["float"]["perplexity"] - 1) <= 0.05


@pytest.mark.slow
def test_a_fine_tuned_classifier_exports_and_int8_keeps_its_accuracy(tmp_path, hf_bert):
    source = write_jsonl(tmp_path / "cls.jsonl", learnable_classes())
    run = tmp_path / "run"
    sets = {
        "run.dir": run,
        "model.source": f"hf:{hf_bert}",
        "model.task": "sequence_classification",
        "data.source": source,
        "data.seq_len": 64,
        "data.val_fraction": 0.2,
        "train.max_steps": 100,
        "train.micro_batch_size": 16,
        "train.global_batch_size": 16,
        "train.lr": 3e-3,
        "eval.every": 0,
    }
    assert main(["train", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]) == 0
    for fmt, more in (("hf", []), ("pt2", []), ("onnx", ["--quantize", "int8"])):
        out = tmp_path / fmt
        assert main(["export", str(run), "--format", fmt, "--out", str(out), *more]) == 0
        info = export_info(out)
        assert "validation records" in info["check"]["inputs"]
        for name in {"hf": ["hf"], "pt2": ["pt2", "aoti"], "onnx": []}[fmt]:
            assert info[name]["max_abs_diff"] <= 1e-4, name
    accuracy = export_info(tmp_path / "onnx")["quantized"]["onnx"]["metric"]
    assert accuracy["float"]["accuracy"] >= 0.8
    assert abs(accuracy["int8"]["accuracy"] - accuracy["float"]["accuracy"]) <= 0.01
