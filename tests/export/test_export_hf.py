"""kiln export --format hf: transformers loads the directory with its own classes and computes
kiln's logits; the export is written whole or not at all."""

import json

import pytest
import torch

from kiln.cli import main
from kiln.train.run import load_run

from conftest import tiny_overrides

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_dir):
    run = tmp_path_factory.mktemp("gpt") / "run"
    sets = tiny_overrides(run, corpus_dir, train__max_steps=4, eval__sample_tokens=0)
    assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
    return run


def test_kilns_gpt_exports_as_a_llama_transformers_loads(gpt_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(out)]) == 0
    info = json.loads((out / "export.json").read_text())
    assert info["step"] == 4 and {"config.json", "model.safetensors", "tokenizer.json"} <= set(info["files"])
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    run = load_run(gpt_run, device="cpu")
    text = "def parse(text):\n    return text.split()"
    ids = torch.tensor([tok(text)["input_ids"]])
    assert ids[0].tolist() == run.tokenizer.encode(text).ids  # the same tokenizer
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, run.model(ids), rtol=0, atol=1e-4)


def test_an_existing_output_is_kept_unless_forced(gpt_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".hf.*"))  # no staging directory left behind


def test_a_missing_run_is_an_error_and_writes_nothing(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    assert "not a kiln run directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
