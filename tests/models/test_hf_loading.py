"""A Hugging Face checkpoint read tensor by tensor into a model built without storage, every
tensor accounted for: its names mapped as transformers maps them (a base model's save into a model
with a head, older names, experts stored one by one), so the model kiln starts from computes what
``from_pretrained`` gives, for every architecture kiln accepts and every form a save takes. Only a
classifier's head may be new; a missing tensor, bad files and a tokenizer that does not fit are
stopped in one line before anything is written."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.cli import main
from kiln.config import ConfigError, ModelConfig
from kiln.models.hf import FAMILY
from kiln.models.init import allocate, params_on_meta

from conftest import sft_records, write_jsonl
from hf_models import DECODERS, ENCODERS, auto_class, bpe_tokenizer, save_tiny, task_of, tiny_config

transformers = pytest.importorskip("transformers")

CLASSIFIER = "sequence_classification"
IDS = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))


def _args(directory, task="causal_lm", labels=(), **model):
    args = FAMILY.resolve(ModelConfig(source=f"hf:{directory}", task=task, **model), vocab_size=0, seq_len=64)
    return dataclasses.replace(args, labels=labels) if labels else args


def _read(args, seed=0):
    """The model as a run's ranks start it: built with its parameters on meta, then filled by name."""
    with params_on_meta():
        model = FAMILY.build(args)
    assert all(p.is_meta for p in model.parameters())
    values = FAMILY.initial_values(args, model, seed)
    assert values is not None
    allocate(model, "cpu")
    values.fill(model)
    return model.eval(), values


def _reference(directory, task, labels=2):
    """transformers' own model of the directory."""
    extra = {"num_labels": labels, "ignore_mismatched_sizes": True} if task == CLASSIFIER else {}
    return auto_class(task).from_pretrained(directory, dtype=torch.float32, **extra).eval()


# Each architecture in two forms that cover the three ways saves differ: with its head, in one
# fp32 file; and headless (a base model's save: an encoder as sentence-transformers saves it, a
# LlamaModel with its output layer tied to the embedding), in bf16 files under an index.
FORMS = {"headed": {}, "headless-sharded-bf16": dict(headless=True, shards=True, dtype=torch.bfloat16)}
CASES = [(model_type, form) for model_type in [*ENCODERS, *DECODERS] for form in FORMS]


@pytest.mark.parametrize("model_type, form", CASES, ids=[f"{t}-{f}" for t, f in CASES])
def test_kilns_model_computes_what_from_pretrained_loads(tmp_path, model_type, form):
    task = task_of(model_type)
    tie = {"tie_word_embeddings": True} if FORMS[form].get("headless") and task == "causal_lm" else {}
    directory = save_tiny(tmp_path / "model", model_type, **FORMS[form], **tie)
    model, values = _read(_args(directory, task, labels=("a", "b") if task == CLASSIFIER else ()))
    reference = _reference(directory, task)
    ours, theirs = model.hf.state_dict(), reference.state_dict()
    assert values.missing == []
    if task == CLASSIFIER and form != "headed":  # the head alone is new: what lies outside the base model
        prefix = reference.base_model_prefix
        assert values.new == sorted(k for k in theirs if not k.startswith(f"{prefix}.")), values.new
        reference.load_state_dict({k: ours[k] for k in values.new}, strict=False)
    else:
        assert values.new == []
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference(IDS).logits, rtol=1e-5, atol=1e-6)
    # One process builds the model the same way (FAMILY.create: what QLoRA and exports load).
    whole = FAMILY.create(_args(directory, task, labels=("a", "b") if task == CLASSIFIER else ()), "cpu", 0)
    assert all(torch.equal(whole.hf.state_dict()[k], v) for k, v in ours.items())


def test_transformers_mapping_is_what_kiln_reads():
    """The private transformers API kiln reads the mapping through (kiln.models.hf.loading's three
    functions): a base model's names into a model with a head, old LayerNorm names, and experts
    stored one by one fused as transformers fuses them. A failure here means transformers changed
    how it loads checkpoints: read core_model_loading.py and conversion_mapping.py again."""
    from kiln.models.hf.loading import _convert, _model_name, _transforms

    with torch.device("meta"):
        bert = transformers.BertForSequenceClassification(tiny_config("bert"))
    transforms = _transforms(bert)
    present = dict.fromkeys(bert.state_dict(), True)
    assert _model_name("encoder.layer.0.output.dense.weight", transforms, "bert", present) == (
        "bert.encoder.layer.0.output.dense.weight",
        None,
    )
    assert _model_name("bert.embeddings.LayerNorm.gamma", transforms, "bert", present)[0] == (
        "bert.embeddings.LayerNorm.weight"
    )
    assert _model_name("cls.predictions.bias", transforms, "bert", present)[0] == "cls.predictions.bias"

    config = transformers.Qwen3MoeConfig(**{**tiny_config("qwen3").to_dict(), "model_type": "qwen3_moe"})
    config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = 3, 2, 16
    with torch.device("meta"):
        moe = transformers.Qwen3MoeForCausalLM(config)
    transforms = _transforms(moe)
    present = dict.fromkeys(moe.state_dict(), True)
    parts: dict[str, list[torch.Tensor]] = {}
    gate = [torch.randn(16, 32) for _ in range(3)]
    up = [torch.randn(16, 32) for _ in range(3)]
    for e in range(3):
        for leaf, value in (("gate_proj", gate[e]), ("up_proj", up[e])):
            # A base model's save: no "model." in front.
            name, pattern = _model_name(f"layers.1.mlp.experts.{e}.{leaf}.weight", transforms, "model", present)
            assert name == "model.layers.1.mlp.experts.gate_up_proj" and pattern is not None
            parts.setdefault(pattern, []).append(value)
    converter = next(c for c in transforms[1] if pattern in c.source_patterns)
    fused = _convert(converter, name, parts, moe)
    assert list(fused) == [name]
    torch.testing.assert_close(fused[name], torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]))


@pytest.mark.parametrize("make", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_experts_stored_one_by_one_are_read_into_the_fused_tensors_from_pretrained_makes(tmp_path, make):
    """transformers saves a mixture of experts one expert at a time (Qwen3-MoE's gate_proj/up_proj/
    down_proj, Mixtral's w1/w3/w2 under block_sparse_moe) and computes with them fused."""
    import hf_models

    directory = getattr(hf_models, make)(tmp_path / make, experts=4)
    model, values = _read(_args(directory))
    fused = {id(source) for source in values.sources.values() if not isinstance(source, str)}
    assert values.missing == [] and len(fused) == 2 * 2  # gate_up_proj and down_proj of each of 2 layers
    want = _reference(directory, "causal_lm").state_dict()
    got = model.hf.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_classifiers_new_head_starts_from_the_seed_and_its_name(hf_bert):
    # Three labels where the directory's head has two: the head is new.
    args = _args(hf_bert, CLASSIFIER, labels=("a", "b", "c"))
    model, values = _read(args, seed=3)
    again, _ = _read(args, seed=3)
    other, _ = _read(args, seed=4)
    reference = _reference(hf_bert, CLASSIFIER, labels=3).state_dict()
    assert values.new == ["classifier.bias", "classifier.weight"]
    assert values.describe() == [
        "weights: load 39 tensors from 1 file, initialise 2 (classifier head: classifier.bias, classifier.weight)"
    ]
    for key, value in model.hf.state_dict().items():
        if key == "classifier.weight":
            assert 0 < value.std() < 0.1 and torch.equal(value, again.hf.state_dict()[key]), key
            assert not torch.equal(value, other.hf.state_dict()[key]), key
        elif key == "classifier.bias":
            assert torch.equal(value, torch.zeros(3))
        else:
            assert torch.equal(value, reference[key]), key


def test_a_masked_lm_save_gives_a_classifier_its_encoder_and_says_what_it_leaves(tmp_path):
    """bert-base-style: the encoder under bert. with its masked-LM head and no pooler. The pooler
    and the classifier are new (the head), the masked-LM head's tensors are listed as unused."""
    config = tiny_config("bert")
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    model, values = _read(_args(tmp_path / "mlm", CLASSIFIER, labels=("a", "b")))
    assert values.new == [
        "bert.pooler.dense.bias",
        "bert.pooler.dense.weight",
        "classifier.bias",
        "classifier.weight",
    ]
    lines = values.describe()
    assert lines[0].startswith("weights: load 37 tensors from 1 file, initialise 4 (classifier head: ")
    assert lines[1].startswith("weights: the model does not use 5 tensors of the files: cls.predictions.bias, ")
    reference = _reference(tmp_path / "mlm", CLASSIFIER).state_dict()
    for key, value in model.hf.state_dict().items():
        if key not in values.new:
            assert torch.equal(value, reference[key]), key


def test_a_decoder_classifier_takes_its_causal_lms_layers_and_leaves_its_output_layer(tmp_path):
    directory = save_tiny(tmp_path / "llama", "llama")
    model, values = _read(_args(directory, CLASSIFIER, labels=("a", "b")))
    assert values.new == ["score.weight"]
    assert values.report.unused == ("lm_head.weight",)
    reference = _reference(directory, CLASSIFIER)
    reference.score.weight.data.copy_(model.hf.score.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference(IDS).logits, rtol=1e-5, atol=1e-6)


def test_a_causal_lm_whose_output_layer_is_not_in_the_files_is_refused_naming_it(tmp_path):
    """A LlamaModel save of a model whose output layer is its own (untied): a causal LM of it would
    predict with a random layer. Refused unless model.allow_missing, which initialises it."""
    directory = save_tiny(tmp_path / "base", "llama", headless=True, tie_word_embeddings=False)
    with pytest.raises(ConfigError) as e:
        _read(_args(directory))
    (error,) = e.value.errors
    assert str(directory / "model.safetensors") in error and "lacks 1 of the model's tensors (lm_head.weight)" in error
    assert "model.allow_missing=true" in error
    model, values = _read(_args(directory, allow_missing=True))
    assert values.missing == ["lm_head.weight"] and values.new == []
    assert values.describe()[1] == ("weights: initialise 1 tensor the files lack (model.allow_missing): lm_head.weight")


@pytest.fixture
def sft(tmp_path):
    return write_jsonl(tmp_path / "sft.jsonl", sft_records(16))


def _train(tmp_path, model_dir, sft, capsys, *extra: str, code: int = 2) -> str:
    """``kiln train`` a step on ``model_dir``; the refusal's one line (stderr), nothing written."""
    run = tmp_path / "run"
    sets = {
        "run.dir": run,
        "model.source": f"hf:{model_dir}",
        "data.source": sft,
        "data.seq_len": 64,
        "data.num_workers": 0,
        "train.max_steps": 1,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2,
        "eval.every": 0,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    capsys.readouterr()
    assert main(["train", *args, *extra]) == code
    out, err = capsys.readouterr()
    if code == 2:
        assert not run.exists()
        assert len(err.strip().splitlines()) == 1, err
    return err if code == 2 else out


def _copy(hf_llama, tmp_path):
    return shutil.copytree(hf_llama, tmp_path / "model")


def test_a_checkpoint_lacking_a_layers_tensor_is_one_line_naming_it_unless_allowed(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    gone = "model.layers.1.mlp.down_proj.weight"
    file = model / index["weight_map"].pop(gone)
    save_file({k: v for k, v in load_file(file).items() if k != gone}, str(file), metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _train(tmp_path, model, sft, capsys)
    assert "model.safetensors.index.json lacks 1 of the model's tensors (model.layers.1.mlp.down_proj.weight)" in err
    out = _train(tmp_path, model, sft, capsys, "--set", "model.allow_missing=true", code=0)
    assert f"initialise 1 tensor the files lack (model.allow_missing): {gone}" in out


def test_an_index_naming_a_missing_file_is_one_line(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    gone = sorted(model.glob("model-*.safetensors"))[1]
    gone.unlink()
    err = _train(tmp_path, model, sft, capsys)
    assert "model.safetensors.index.json" in err and gone.name in err


def test_a_truncated_file_is_one_line_naming_it(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    cut = sorted(model.glob("model-*.safetensors"))[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    err = _train(tmp_path, model, sft, capsys)
    assert cut.name in err


def test_shapes_that_do_not_match_the_config_are_one_line_naming_the_tensor(tmp_path, hf_llama, sft, capsys):
    model = _copy(hf_llama, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    err = _train(tmp_path, model, sft, capsys)
    assert "model.source:" in err and "mlp.down_proj.weight has shape [64, 128]" in err and "[64, 96]" in err, err


def _without_end_of_text(directory, model_type):
    """A tokenizer with a start token but no end-of-text or padding token, beside a tiny model of it."""
    tok = bpe_tokenizer(directory)
    bare = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token="<s>")
    bare.chat_template = tok.chat_template
    bare.save_pretrained(directory)
    return save_tiny(directory, model_type, vocab_size=len(bare), pad_token_id=None, eos_token_id=None)


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_in_one_line(tmp_path, sft, capsys):
    """transformers' Qwen2 tokenizer adds <|endoftext|> to a tokenizer that has none, one id past
    the model's embedding: refused, where it once ended in an IndexError in the embedding."""
    model = _without_end_of_text(tmp_path / "qwen2", "qwen2")
    err = _train(tmp_path, model, sft, capsys)
    assert "its tokenizer (Qwen2Tokenizer) has 1 token(s) past the model's" in err and "'<|endoftext|>'" in err


def test_a_tokenizer_without_end_or_padding_tokens_still_trains(tmp_path, sft, capsys):
    """Rows are padded with id 0 where the tokenizer names no padding or end token (padding is
    masked and never a target)."""
    model = _without_end_of_text(tmp_path / "llama", "llama")
    out = _train(tmp_path, model, sft, capsys, "--set", "train.micro_batch_size=2", code=0)
    assert "step 1/1" in out


def test_a_directory_of_quantized_weights_is_refused_in_one_line(tmp_path, hf_llama, sft, capsys):
    """Pre-quantized checkpoints (fp8, GPTQ, bitsandbytes: quantization_config in config.json) store
    scales beside integer weights; kiln reads none of that, and says so before anything runs."""
    model = _copy(hf_llama, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    err = _train(tmp_path, model, sft, capsys)
    assert "describes quantized weights (quantization_config: fp8)" in err and "config.json" in err
