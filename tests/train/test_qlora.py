"""QLoRA (``lora.quantize_base = "nf4"``): the adapted layers' frozen weights are 4-bit NF4
tensors, only the adapters train, the forward is the float one up to NF4's rounding, a resumed
run continues exactly, and exports merge the adapters into the dequantized base."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_finetune import as_args, ft_sets, losses

from kiln.checkpoint import load_checkpoint
from kiln.cli import main
from kiln.config import ConfigError, load_config
from kiln.models import GPT, GPTConfig
from kiln.models.family import family_of, get_family
from kiln.train.apply import _nf4, apply_lora, merge_lora
from kiln.train.jobs import job_for
from kiln.train.run import load_run
from kiln.train.trainer import Trainer

from conftest import sft_records, write_jsonl

GPT_FAMILY, HF_FAMILY = get_family("gpt"), get_family("hf")

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")
NF4Tensor = _nf4()[0]  # wherever this torchao keeps it


def sets(run_dir: Path, source: Path, model_dir: Path, **extra) -> list[str]:
    """The fine-tuning tests' run, with QLoRA adapters of rank 8."""
    qlora = dict(train__lr=1e-2, lora__rank=8, lora__alpha=16, lora__dropout=0.0, lora__quantize_base="nf4")
    return ft_sets(run_dir, source, model_dir, **{**qlora, **extra})


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of memory behind a tensor: for an NF4 tensor, its codes, scales and lookup table."""
    if isinstance(t, NF4Tensor):
        return sum(getattr(t, name).untyped_storage().nbytes() for name in t.__tensor_flatten__()[0])
    return t.untyped_storage().nbytes()


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("sft") / "sft.jsonl", sft_records(96))


@pytest.fixture(scope="module")
def models(hf_llama):
    """The tiny Llama as kiln loads it: plain (fp32), and with QLoRA applied."""
    cfg = load_config(None, sets(Path("unused"), Path("unused"), hf_llama))
    family = family_of(cfg.model)
    args = family.resolve(cfg.model, vocab_size=0, seq_len=64)
    plain = family.create(args, "cpu", 0).eval()
    quantized = apply_lora(family.create(args, "cpu", 0), cfg, family, args).eval()
    return plain, quantized


@pytest.fixture(scope="module")
def gpt():
    """kiln's GPT, plain and with QLoRA, with projections of 64K and 128K weights: NF4's scales
    come in several groups, as in real models."""
    dims = dict(vocab_size=256, n_layer=2, d_model=256, n_head=4, n_kv_head=4, d_ff=512, max_seq_len=64)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**dims, tie_embeddings=True)).eval()
    cfg = load_config(None, ["run.device=cpu", "lora.rank=8", "lora.quantize_base=nf4"])
    args = GPTConfig(**dims, tie_embeddings=True)  # the family's default targets: every projection
    quantized = apply_lora(copy.deepcopy(plain), cfg, GPT_FAMILY, args).eval()
    return plain, quantized


def test_the_adapted_weights_are_4_bit(gpt):
    plain, quantized = gpt
    floats = dict(plain.named_parameters())
    nf4 = {n: p for n, p in quantized.named_parameters() if isinstance(p, NF4Tensor)}
    assert len(nf4) == 14 and all(n.endswith(".base_layer.weight") for n in nf4)
    before = sum(stored_bytes(floats[n.replace(".base_layer", "")]) for n in nf4)
    after = sum(stored_bytes(p) for p in nf4.values())
    # 4 bits a weight, an 8-bit scale per 64 weights and a little per group of scales: 0.516
    # bytes a weight, where fp32 takes 4 (and bf16 2: 3.9 times less).
    assert 4 / 0.52 < before / after < 4 / 0.5, (before, after)
    for name, param in quantized.named_parameters():
        assert param.requires_grad == ("lora_" in name)
        if "lora_" not in name and name not in nf4:
            assert torch.equal(param, floats[name])  # nothing else is quantized


def test_merging_folds_trained_adapters_into_the_dequantized_base(gpt):
    _, quantized = gpt
    with torch.no_grad():
        for name, param in quantized.named_parameters():
            if "lora_B" in name:  # as if trained: B starts at zero
                param.copy_(torch.randn_like(param) * 0.05)
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
        merged = merge_lora(quantized, GPT_FAMILY)
        torch.testing.assert_close(merged(ids), quantized(ids), rtol=0, atol=1e-5)
    assert not any(isinstance(p, NF4Tensor) or "lora_" in n for n, p in merged.named_parameters())
    assert sum(isinstance(p, NF4Tensor) for p in quantized.parameters()) == 14  # the original is untouched


def test_only_the_adapters_get_gradients(models):
    _, quantized = models
    quantized.train()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    quantized(ids, labels=ids).backward()
    with_grad = {n for n, p in quantized.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in quantized.named_parameters() if p.requires_grad}
    assert with_grad and all("lora_" in n for n in with_grad)
    quantized.zero_grad(set_to_none=True)
    quantized.eval()


def test_the_quantized_forward_is_the_float_forward_up_to_nf4_rounding(models):
    plain, quantized = models
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        floats, logits = plain(ids), quantized(ids)
        # Exactly the model whose weights are the dequantized NF4 ones (the adapters start at zero).
        torch.testing.assert_close(logits, merge_lora(quantized, HF_FAMILY)(ids), rtol=0, atol=1e-5)
    # NF4 rounds Gaussian weights with a relative RMS error of about 9%; the logits are off by
    # no more than one layer's output is (the embedding and the output layer stay exact).
    relative = ((logits - floats).norm() / floats.norm()).item()
    assert 0.01 < relative < 0.15, relative


def _train(run: Path, sft: Path, hf_llama: Path, **extra) -> dict[int, float]:
    assert main(["train", *as_args(sets(run, sft, hf_llama, **extra))]) == 0
    return losses(run)


def _resume_and_export(run: Path, tmp_path: Path, sft: Path, hf_llama: Path, *, exact: bool = True, **extra) -> None:
    """A copy of ``run`` resumed from its step-4 checkpoint gives the same losses; loaded for use
    it computes what it trained; ``kiln export --format hf`` writes a merged model transformers
    loads, and ``--format safetensors`` the same weights."""
    full = losses(run)
    assert len(full) == 8 and sum(list(full.values())[-2:]) < sum(list(full.values())[:2])  # it learns
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    got = _train(resumed, sft, hf_llama, **extra)
    assert got == (full if exact else pytest.approx(full, rel=1e-3))

    # Loaded for use, the base is the checkpoint's, dequantized: it computes what the 4-bit one
    # computed (rebuilt here as training built it, from the source, then loaded), exactly.
    loaded = load_run(run, device="cpu")
    assert not any(isinstance(p, NF4Tensor) for p in loaded.model.parameters())
    cfg, family, args = loaded.cfg, loaded.family, loaded.args
    trained = apply_lora(family.create(args, "cpu", cfg.train.seed), cfg, family, args).eval()
    trained.load_state_dict(load_checkpoint(loaded.checkpoint)[0])
    assert sum(isinstance(p, NF4Tensor) for p in trained.parameters()) == 14
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), trained(ids), rtol=0, atol=0)

    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "export.json").read_text())["hf"]["max_abs_diff"] <= 1e-4
    weights = tmp_path / "weights"  # kiln's names, loaded back as a run is
    assert main(["export", str(run), "--format", "safetensors", "--out", str(weights)]) == 0
    assert json.loads((weights / "export.json").read_text())["safetensors"]["max_abs_diff"] == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any(isinstance(p, NF4Tensor) for p in merged.parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained(ids), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, sft, hf_llama) -> Path:
    run = tmp_path_factory.mktemp("qlora") / "run"
    _train(run, sft, hf_llama)
    return run


def test_qlora_learns_resumes_exactly_and_exports_merged(qlora_run, tmp_path, sft, hf_llama):
    _resume_and_export(qlora_run, tmp_path, sft, hf_llama)


@pytest.mark.slow
@pytest.mark.dist
def test_two_ddp_ranks_give_the_losses_of_one_process(qlora_run, tmp_path, sft, hf_llama):
    run = tmp_path / "ddp"
    cmd = ["launch", "--nproc-per-node", "2", "--", "train"]
    assert main([*cmd, *as_args(sets(run, sft, hf_llama, train__micro_batch_size=1))]) == 0
    got, want = losses(run), losses(qlora_run)
    assert got.keys() == want.keys()
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.gpu
def test_qlora_on_cuda_in_bf16(tmp_path, sft, hf_llama):
    extra = dict(run__device="cuda", train__precision="bf16")
    run = tmp_path / "run"
    trainer = Trainer(job_for(load_config(None, sets(run, sft, hf_llama, **extra))), console=False)
    nf4 = [p for p in trainer.model.module.parameters() if isinstance(p, NF4Tensor)]
    assert len(nf4) == 14 and all(p.is_cuda and p.quantized_data.is_cuda for p in nf4)
    trainer.fit()
    # Some CUDA kernels (attention's backward) add in no fixed order: equal up to rounding.
    _resume_and_export(run, tmp_path, sft, hf_llama, exact=False, **extra)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"lora.rank": 0}, "set lora.rank too"),
        ({"parallel.strategy": "fsdp"}, "use parallel.strategy=ddp"),
        ({"parallel.pp": 2}, "use parallel.strategy=ddp"),
        ({"lora.quantize_base": "int4"}, "choose one of none, nf4"),
    ],
)
def test_what_qlora_cannot_do_is_refused_naming_the_key(tmp_path, hf_llama, extra, message):
    items = sets(tmp_path / "run", tmp_path, hf_llama) + [f"{k}={v}" for k, v in extra.items()]
    with pytest.raises(ConfigError) as e:
        load_config(None, items)
    assert any("lora.quantize_base: " in line and message in line for line in e.value.errors), e.value
