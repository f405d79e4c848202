"""The hf family on the architectures people fine-tune: for each, a tiny random model made here
(nothing is downloaded) trains a few steps through ``kiln train`` (GPT-2 with LoRA on its default
targets), ``kiln export --format hf`` writes it, and ``transformers`` loads the export back and
computes what kiln's model computes. Beside them: the LoRA default targets of each architecture,
eager attention where ``transformers`` has no SDPA, RoBERTa's shorter context, and the libraries'
import noise kept out of a run's output."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.compat import quiet_library_warnings
from kiln.config import ConfigError, ModelConfig
from kiln.models.hf import FAMILY, HFArgs, attention
from kiln.train.run import load_run

from conftest import sft_records, write_jsonl
from hf_models import auto_class, bpe_tokenizer, learnable_classes, tiny_config, wordpiece_tokenizer
from kilnrun import in_process, losses

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.e2e

BERT_TARGETS = [
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
]
LLAMA_TARGETS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str  # the model_type (its tiny config: hf_models.tiny_config)
    task: str  # causal_lm | sequence_classification
    targets: list[str]  # kiln's default LoRA targets: every linear layer of the repeated layers
    lora: bool = False  # trained with LoRA
    no_pad: bool = False  # config.json without pad_token_id, as many causal LMs' are

    @property
    def id(self) -> str:
        return f"{self.name}-classifier" if self.task == CLASSIFIER and self.name in CAUSAL_TYPES else self.name


CAUSAL, CLASSIFIER = "causal_lm", "sequence_classification"
CAUSAL_TYPES = ("llama",)  # those also tested as classifiers
ARCHS = [
    Arch("llama", CAUSAL, LLAMA_TARGETS),
    Arch("qwen3", CAUSAL, LLAMA_TARGETS),
    Arch("gemma3_text", CAUSAL, LLAMA_TARGETS),
    Arch("phi3", CAUSAL, ["self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"]),
    Arch("gpt2", CAUSAL, ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"], lora=True),
    Arch(
        "gpt_neox",
        CAUSAL,
        ["attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"],
    ),
    Arch(
        "opt", CAUSAL, ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj", "fc1", "fc2"]
    ),
    # A decoder as a classifier: its last token's state is classified, found by the padding id that
    # its config.json lacks (kiln takes the tokenizer's).
    Arch("llama", CLASSIFIER, LLAMA_TARGETS, no_pad=True),
    Arch("bert", CLASSIFIER, BERT_TARGETS),
    Arch(
        "distilbert",
        CLASSIFIER,
        ["attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "ffn.lin1", "ffn.lin2"],
    ),
    Arch("roberta", CLASSIFIER, BERT_TARGETS),
    Arch(
        "deberta-v2", CLASSIFIER, [*(f"attention.self.{p}_proj" for p in ("query", "key", "value")), *BERT_TARGETS[3:]]
    ),
    Arch("modernbert", CLASSIFIER, ["attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo"]),
    Arch("electra", CLASSIFIER, BERT_TARGETS),
]
IDS = [a.id for a in ARCHS]


def tiny(arch: Arch, vocab_size: int = 96, pad: int = 0, bos: int = 1, eos: int = 2):
    return tiny_config(arch.name, vocab_size, pad, bos, eos)


def make(arch: Arch, directory: Path) -> Path:
    """The architecture with random weights, saved in safetensors with a tokenizer of its kind."""
    if arch.task == CAUSAL:
        tok = bpe_tokenizer(directory)
        config = tiny(arch, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        auto = transformers.AutoModelForCausalLM
    else:
        tok = wordpiece_tokenizer(directory)
        config = tiny(arch, len(tok), tok.pad_token_id, tok.cls_token_id, tok.sep_token_id)
        auto = transformers.AutoModelForSequenceClassification
    if arch.no_pad:
        config.pad_token_id = None
    torch.manual_seed(0)
    auto.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("records")
    return {
        CAUSAL: write_jsonl(root / "sft.jsonl", sft_records(32)),
        CLASSIFIER: write_jsonl(root / "cls.jsonl", learnable_classes(32)),
    }


def run_sets(run: Path, model: Path, arch: Arch, data: Path) -> list[str]:
    items = {
        "run.dir": run,
        "run.device": "cpu",
        "model.source": f"hf:{model}",
        "model.task": arch.task,
        "data.source": data,
        "data.num_workers": 0,
        "data.seq_len": 48,
        "train.max_steps": 3,
        "train.micro_batch_size": 4,
        "train.global_batch_size": 4,
        "train.lr": 2e-2 if arch.lora else 3e-3,
        "train.warmup_steps": 0,
        "train.log_every": 1,
        "eval.every": 0,
        "eval.sample_tokens": 4,
        "checkpoint.every": 0,
    }
    if arch.lora:
        items.update({"lora.rank": 4, "lora.alpha": 8, "lora.dropout": 0.0})
    return [a for k, v in items.items() for a in ("--set", f"{k}={v}")]


# Llama and BERT train, export and load back in tests/train/test_finetune.py's quick tier already.
COVERED = ("llama", "bert")


@pytest.mark.parametrize(
    "arch", [pytest.param(a, id=a.id, marks=[pytest.mark.slow] if a.id in COVERED else []) for a in ARCHS]
)
def test_trains_exports_and_loads_back_in_transformers(tmp_path, records, arch):
    model = make(arch, tmp_path / "model")
    run = tmp_path / "run"
    proc = in_process("train", *run_sets(run, model, arch, records[arch.task]))
    described = proc.stdout + proc.stderr
    steps = losses(run)
    assert len(steps) == 3 and all(math.isfinite(v) for v in steps.values()), steps
    # With LoRA too: its default targets are every linear layer of the blocks (GPT-2's attention
    # and MLP Conv1D layers; with PEFT's c_attn alone, GPT-2 learned nothing measurable).
    assert steps[3] < steps[1], steps
    # Said once, in the model's line, where transformers has no SDPA for the architecture.
    assert described.count("eager attention") == (arch.name == "deberta-v2"), described

    out = tmp_path / "export"
    in_process("export", run, "--format", "hf", "--out", out)
    exported = auto_class(arch.task).from_pretrained(out).eval()
    assert exported.config.model_type == arch.name
    kiln_model = load_run(run, device="cpu").model.eval()
    ids = torch.randint(3, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = exported(ids).logits
        torch.testing.assert_close(logits, kiln_model(ids), rtol=0, atol=1e-4)
        if arch.task == CAUSAL:  # kiln's loss (fused from the hidden states where it can) is transformers' own
            torch.testing.assert_close(kiln_model(ids, labels=ids), exported(ids, labels=ids).loss, rtol=0, atol=1e-4)
        if arch.lora:
            adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
            assert sorted(adapter["target_modules"]) == sorted(arch.targets) and adapter["fan_in_fan_out"]  # Conv1D
            base = auto_class(arch.task).from_pretrained(model).eval()
            assert (base(ids).logits - logits).abs().max() > 1e-4  # the adapters trained


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_lora_default_targets_are_found_in_the_model(arch):
    peft = pytest.importorskip("peft")
    args = HFArgs("tiny", arch.task, tiny(arch).to_dict(), "random")
    targets = FAMILY.lora_targets(args)
    assert targets == arch.targets
    config = peft.LoraConfig(r=2, target_modules=targets, fan_in_fan_out=arch.lora)
    with quiet_library_warnings():
        adapted = peft.get_peft_model(FAMILY.build(args).hf, config)
    layers = [name for name, m in adapted.named_modules() if hasattr(m, "lora_A")]
    # Each target in each of the two layers, and nothing outside them (a classifier's head).
    assert len(layers) == 2 * len(targets) and all(".0." in name or ".1." in name for name in layers), layers


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_what_kiln_reads_from_the_config_comes_through_its_attribute_map(arch):
    """DistilBERT's dim/n_heads/n_layers and GPT-2's n_embd/n_head/n_layer/n_positions are read as
    hidden_size, num_attention_heads, num_hidden_layers, max_position_embeddings."""
    args = HFArgs("tiny", arch.task, tiny(arch).to_dict(), "random")
    assert FAMILY.head_dim(args) == 8
    assert FAMILY.memory_model(args).n_layer == 2
    assert FAMILY.flops_per_token(args, 16) > 0
    assert FAMILY.parallel_plan(args).block_type is not None
    # RoBERTa's positions start after the padding id (0 here): one fewer than max_position_embeddings.
    assert FAMILY.context_length(args) == (129 if arch.name == "roberta" else 128)
    assert attention(args) == ("eager" if arch.name == "deberta-v2" else "sdpa")


def test_roberta_is_refused_a_sequence_longer_than_its_positions(tmp_path):
    arch = next(a for a in ARCHS if a.name == "roberta")
    config = tiny(arch)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))

    def resolve(seq_len):
        cfg = ModelConfig(source=f"hf:{tmp_path}", task=CLASSIFIER, weights="random")
        return FAMILY.resolve(cfg, vocab_size=0, seq_len=seq_len)

    with pytest.raises(ConfigError, match="data.seq_len: 130 is longer than the model's context"):
        resolve(130)
    model = FAMILY.build(resolve(129)).eval()
    with torch.no_grad():
        assert model(torch.randint(3, 96, (1, 129))).shape == (1, 2)  # its longest sequence runs


def test_library_import_noise_is_dropped_and_nothing_else():
    from kiln.compat import quiet_library_imports

    quiet_library_imports()
    quiet_library_imports()  # once is enough; twice adds nothing
    assert len(logging.getLogger("torchao").filters) == 1

    def shown(logger: str, msg: str, *args: object) -> bool:
        record = logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, args, None)
        return bool(logging.getLogger(logger).filter(record))

    assert not shown("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library: /x/_C_mxfp8.so")
    assert not shown("torchao", "Skipping import of cpp extensions due to incompatible torch version. Please ...")
    enum = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. ..."
    assert not shown("torch.utils._pytree", enum, "<enum 'KernelPreference'>")
    assert shown("torchao", "something else torchao says")
    assert shown("torch.utils._pytree", "another pytree warning")
    assert shown("kiln", "Failed to load my own thing")


@pytest.mark.slow
@pytest.mark.skipif(find_spec("torchao") is None or find_spec("peft") is None, reason="needs torchao and peft")
def test_importing_the_libraries_as_kiln_does_prints_nothing():
    """A fresh interpreter: transformers, then peft and torchao's float8 training, as a LoRA or fp8
    run imports them, without torchao's .so failures or torch's pytree deprecation lines."""
    code = (
        "from kiln.models.hf.loading import transformers_module; transformers_module()\n"
        "from kiln.compat import quiet_library_imports; quiet_library_imports()\n"
        "import peft, torchao.float8, torchao.quantization\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == "", proc.stderr


def test_packing_is_refused_where_packed_records_would_see_each_other(tmp_path, records, capsys):
    arch = next(a for a in ARCHS if a.name == "opt")
    model = make(arch, tmp_path / "model")
    sets = [*run_sets(tmp_path / "run", model, arch, records[CAUSAL]), "--set", "data.packing=true"]
    capsys.readouterr()  # transformers' progress bar while the model was saved
    assert main(["train", *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.packing:" in err and "attend to each other" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
