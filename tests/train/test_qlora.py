"""QLoRA (``lora.quantize_base = "nf4"``): the adapted layers' frozen weights are 4-bit NF4
tensors, only the adapters train, the forward is the float one up to NF4's rounding, a resumed
run continues exactly, and exports merge the adapters into the dequantized base; DDP, FSDP
(each rank keeping its rows of the 4-bit weights) and pipeline stages train as one process."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_finetune import as_args, ft_sets, losses

from kiln.checkpoint import load_checkpoint, load_sharded
from kiln.cli import main
from kiln.config import ConfigError, load_config
from kiln.models import GPT, GPTConfig
from kiln.models.family import family_of, get_family
from kiln.train.apply import _nf4, apply_lora, check_quantized_shards, merge_lora
from kiln.train.jobs import job_for
from kiln.train.run import load_run
from kiln.train.trainer import Trainer

from conftest import sft_records, write_jsonl
from kilnrun import in_process, launch
from layouts import layout_sets, train_on, weights

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


def test_other_values_loaded_into_a_4_bit_weight_are_quantized(gpt):
    plain, quantized = gpt
    cfg = load_config(None, ["run.device=cpu", "lora.rank=8", "lora.quantize_base=nf4"])
    model = apply_lora(copy.deepcopy(plain), cfg, GPT_FAMILY, plain.config)
    key = "blocks.0.attn.wq.base_layer.weight"
    state = quantized.state_dict()
    state[key] = state[key] * 2
    model.load_state_dict(state)
    weight = model.get_parameter(key)
    assert isinstance(weight, NF4Tensor)
    assert (weight.get_original_weight() - state[key]).abs().max() < 0.01 * state[key].abs().max()


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


def _train(run: Path, sft: Path, model_dir: Path, nproc: int = 1, **extra) -> dict[int, float]:
    """The run of ``sets`` in one process, or launched on ``nproc`` gloo ranks; its losses."""
    args = ["train", *as_args(sets(run, sft, model_dir, **extra))]
    if nproc > 1:
        launch(nproc, *args)
    else:
        assert main(args) == 0
    return losses(run)


def _resume_and_export(
    run: Path, tmp_path: Path, sft: Path, model_dir: Path, *, nproc: int = 1, exact: bool = True, **extra
) -> None:
    """A copy of ``run`` resumed from its step-4 checkpoint (on ``nproc`` ranks, as it ran) gives
    the same losses; loaded for use it computes what it trained; ``kiln export --format hf``
    writes a merged model transformers loads and the adapter PEFT loads, and ``--format
    safetensors`` the same weights."""
    full = losses(run)
    assert len(full) == 8 and sum(list(full.values())[-2:]) < sum(list(full.values())[:2])  # it learns
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    got = _train(resumed, sft, model_dir, nproc, **extra)
    assert got == (full if exact else pytest.approx(full, rel=1e-3))

    # Loaded for use, the base is the checkpoint's, dequantized: it computes what the 4-bit one
    # computed (rebuilt here as training built it, from the source, then loaded), exactly.
    loaded = load_run(run, device="cpu")
    assert not any(isinstance(p, NF4Tensor) for p in loaded.model.parameters())
    cfg, family, args = loaded.cfg, loaded.family, loaded.args
    trained = apply_lora(family.create(args, "cpu", cfg.train.seed), cfg, family, args).eval()
    state = load_checkpoint(loaded.checkpoint)[0]
    if state is None:  # sharded: DCP fills the model's own state dict, its 4-bit weights dequantized
        state = trained.state_dict()
        load_sharded(loaded.checkpoint, {"model": state})
    trained.load_state_dict(state)
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
    # The adapter, trained against the 4-bit base, goes onto the source model as PEFT loads it.
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir), out / "adapter"
    )
    theirs = {n: p for n, p in adapted.named_parameters() if "lora_" in n}
    ours = {n.removeprefix("hf."): p for n, p in loaded.model.named_parameters() if "lora_" in n}
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[n], ours[n]) for n in ours)


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
    got, want = _train(tmp_path / "ddp", sft, hf_llama, nproc=2, train__micro_batch_size=1), losses(qlora_run)
    assert got.keys() == want.keys()
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
@pytest.mark.dist
def test_two_pipeline_stages_give_the_losses_of_one_process_and_resume_exactly(qlora_run, tmp_path, sft, hf_llama):
    """Each stage holds its layers' 4-bit base and adapters (PEFT's wrapper around the cut model)."""
    run = tmp_path / "pp"
    got = _train(run, sft, hf_llama, nproc=2, parallel__pp=2)
    assert got == pytest.approx(losses(qlora_run), rel=1e-5)
    _resume_and_export(run, tmp_path, sft, hf_llama, nproc=2, parallel__pp=2)


# Two FSDP ranks: each keeps its rows of every 4-bit weight, one sequence a micro-batch each.
FSDP = dict(parallel__strategy="fsdp", train__micro_batch_size=1)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """The tiny Llama with projections of 32K weights: two groups of NF4 scales each, which two
    FSDP ranks can share (the tiny one's projections hold one group each)."""
    from hf_models import tiny_llama

    dims = dict(hidden_size=128, intermediate_size=256, head_dim=64, n_kv_head=4)
    return tiny_llama(tmp_path_factory.mktemp("wide"), shards=True, **dims)


@pytest.fixture(scope="module")
def fsdp_qlora(tmp_path_factory, sft, wide_llama) -> Path:
    run = tmp_path_factory.mktemp("fsdp-qlora") / "run"
    _train(run, sft, wide_llama, nproc=2, **FSDP)
    return run


@pytest.mark.slow
@pytest.mark.dist
def test_two_fsdp_ranks_share_the_4_bit_base_and_give_the_losses_of_one_process(fsdp_qlora, tmp_path, sft, wide_llama):
    one = tmp_path / "one"
    assert losses(fsdp_qlora) == pytest.approx(_train(one, sft, wide_llama), rel=1e-5)
    # The sharded checkpoint holds the base dequantized, in plain tensors (DCP wrote each rank's
    # rows), bitwise the one process's: the ranks' rows of a weight are the rows of its NF4.
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(fsdp_qlora / "checkpoints" / "step-00000008" / "state")).read_metadata()
    model = {k: v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert {v.properties.dtype for v in model.values()} == {torch.float32}
    sharded, whole = load_run(fsdp_qlora, device="cpu").model, load_run(one, device="cpu").model
    for (name, a), b in zip(sharded.state_dict().items(), whole.state_dict().values(), strict=True):
        if "lora_" not in name:
            assert torch.equal(a, b), name
    # HSDP: two replicas of the two ranks sharing the base (4 ranks).
    hsdp = tmp_path / "hsdp"
    launch(4, "train", *as_args(sets(hsdp, sft, wide_llama, parallel__dp_replicate=2, **FSDP)))
    assert losses(hsdp) == pytest.approx(losses(one), rel=1e-5)


@pytest.mark.slow
@pytest.mark.dist
def test_an_fsdp_qlora_run_resumes_exactly_and_exports_merged(fsdp_qlora, tmp_path, sft, wide_llama):
    _resume_and_export(fsdp_qlora, tmp_path, sft, wide_llama, nproc=2, **FSDP)


def test_fsdp_ranks_that_cannot_share_a_4_bit_weight_evenly_are_refused_naming_it(models):
    _, quantized = models
    check_quantized_shards(quantized, 1)
    with pytest.raises(ConfigError) as e:
        check_quantized_shards(quantized, 2)
    (line,) = e.value.errors
    layer = "hf.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight [64, 64]"
    assert line.startswith(f"lora.quantize_base: FSDP cannot split {layer} over 2 ranks: "), line
    assert "use parallel.strategy=ddp" in line


@pytest.mark.slow
@pytest.mark.dist
def test_pipeline_stages_of_a_4_bit_base_give_the_losses_of_one_process(tmp_path, corpus_dir):
    """kiln's GPT, whose tied embedding (frozen) is on both end stages."""
    qlora = dict(lora__rank=4, lora__alpha=8, lora__dropout=0, lora__quantize_base="nf4")
    one, pp = tmp_path / "one", tmp_path / "pp"
    in_process("train", *layout_sets(one, corpus_dir, micro=4, **qlora))
    train_on(2, layout_sets(pp, corpus_dir, micro=4, parallel__pp=2, **qlora))
    assert losses(pp) == pytest.approx(losses(one), rel=1e-5)
    # A pipeline's checkpoint is sharded: it holds the base dequantized too.
    for (name, a), b in zip(weights(pp).items(), weights(one).values(), strict=True):
        if "lora_" not in name:
            assert torch.equal(a, b), name


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
        ({"lora.quantize_base": "int4"}, "choose one of none, nf4"),
    ],
)
def test_what_qlora_cannot_do_is_refused_naming_the_key(tmp_path, hf_llama, extra, message):
    items = sets(tmp_path / "run", tmp_path, hf_llama) + [f"{k}={v}" for k, v in extra.items()]
    with pytest.raises(ConfigError) as e:
        load_config(None, items)
    assert any("lora.quantize_base: " in line and message in line for line in e.value.errors), e.value


@pytest.mark.parametrize(
    "layout",
    [{"parallel.strategy": "fsdp", "parallel.cpu_offload": "true"}, {"parallel.pp": 2}, {"parallel.strategy": "ddp"}],
)
def test_qlora_takes_every_layout_but_tensor_parallelism(tmp_path, hf_llama, layout):
    items = sets(tmp_path / "run", tmp_path, hf_llama) + [f"{k}={v}" for k, v in layout.items()]
    load_config(None, items)
    with pytest.raises(ConfigError, match="lora.quantize_base: nf4 packs the frozen base in blocks"):
        load_config(None, [*items, "parallel.tp=2"])
