"""CUDA paths: run where a GPU is present (skipped elsewhere, see conftest)."""

import numpy as np
import pytest
import torch

from kiln import Trainer
from kiln.config import load_config
from kiln.data import TokenSequences
from kiln.models import GPT, GPTConfig
from kiln.models.lm import lm_loss

pytestmark = pytest.mark.gpu


def _data(tmp_path, vocab=256, n=100_000):
    path = tmp_path / "tokens.bin"
    base = np.tile(np.arange(vocab, dtype=np.uint16), n // vocab + 1)[:n]
    base.tofile(path)
    return TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), 64)


def _fit(tmp_path, precision, **extra):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=256, n_layer=2, d_model=128, n_head=4, n_kv_head=2, d_ff=256, max_seq_len=64, tie_embeddings=True
        )
    )
    sets = [
        f"run.dir={tmp_path / precision}",
        "run.device=cuda",
        "train.max_steps=40",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "train.lr=3e-3",
        "train.warmup_steps=5",
        "train.log_every=5",
        f"train.precision={precision}",
        "data.num_workers=2",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    sets += [f"{k}={v}" for k, v in extra.items()]
    trainer = Trainer(model, _data(tmp_path), lm_loss, load_config(None, sets), tokens_per_sample=64, console=False)
    return trainer, trainer.fit()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_training_learns(tmp_path, precision):
    trainer, result = _fit(tmp_path, precision)
    assert trainer.optimizer.defaults["fused"] is True
    assert result.metrics["loss"] < 3.0  # from ln(256) = 5.5 on a perfectly predictable stream
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if precision == "fp16":
        assert result.metrics["loss_scale"] > 0 and "skipped_steps" in result.metrics
    # Peak device memory of the last log interval: the model, its optimizer state, activations.
    peak, reserved = result.metrics["memory/peak_allocated_gib"], result.metrics["memory/peak_reserved_gib"]
    assert 0 < peak <= reserved < 80


def test_precision_auto_is_bf16_on_a_bf16_gpu(tmp_path):
    trainer, result = _fit(tmp_path, "auto")
    expected = "bf16" if torch.cuda.get_device_capability() >= (8, 0) else "fp32"
    assert trainer.cfg.train.precision == trainer.precision.mode == expected
    assert f'precision = "{expected}"' in (tmp_path / "auto" / "config.toml").read_text()


def test_compile_and_activation_checkpointing_on_cuda(tmp_path):
    _, result = _fit(tmp_path, "bf16", **{"train.compile": "true", "train.activation_checkpointing": "true"})
    assert result.metrics["loss"] < 3.0


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="float8 needs sm_89+"
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_with_compile_learns_as_bf16_does(tmp_path, recipe):
    pytest.importorskip("torchao")
    trainer, result = _fit(tmp_path, "fp8", **{"train.compile": "true", "train.fp8_recipe": recipe})
    assert type(trainer.model.module.get_submodule("blocks.0.mlp.w1")).__name__ == "Float8Linear"
    _, bf16 = _fit(tmp_path / "reference", "bf16")
    assert abs(result.metrics["loss"] - bf16.metrics["loss"]) / bf16.metrics["loss"] < 0.05


def test_flash_attention_kernel_runs():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = GPT(
        GPTConfig(
            vocab_size=256,
            n_layer=2,
            d_model=128,
            n_head=4,
            n_kv_head=2,
            d_ff=256,
            max_seq_len=128,
            tie_embeddings=True,
        )
    ).cuda()
    idx = torch.randint(0, 256, (2, 128), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
        logits.float().sum().backward()
    assert torch.isfinite(logits).all()


def test_fsdp_cpu_offload_in_one_process(tmp_path):
    """parallel.cpu_offload alone on one GPU: FSDP over a group of one keeps the state in CPU memory."""
    from torch.distributed.tensor import DTensor

    trainer, result = _fit(
        tmp_path, "bf16", **{"parallel.strategy": "fsdp", "parallel.cpu_offload": "true", "checkpoint.every": "20"}
    )
    assert result.metrics["loss"] < 3.0
    params = list(trainer.model.parameters())
    assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params)
    assert (tmp_path / "bf16" / "checkpoints" / "step-00000040" / "state").is_dir()  # saved with DCP


def _overflowing_run(tmp_path, micro):
    """A step of 4M tokens: as one micro-batch its activations need several times an 80 GB card."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=256,
            n_layer=4,
            d_model=512,
            n_head=8,
            n_kv_head=8,
            d_ff=1536,
            max_seq_len=64,
            tie_embeddings=True,
        )
    )
    sets = [
        f"run.dir={tmp_path / str(micro)}",
        "run.device=cuda",
        "train.max_steps=2",
        f"train.micro_batch_size={micro}",
        "train.global_batch_size=65536",
        "train.precision=bf16",
        "data.num_workers=2",
        "eval.every=0",
        "checkpoint.every=0",
        "train.log_every=1",
    ]
    trainer = Trainer(
        model, _data(tmp_path, n=5_000_000), lm_loss, load_config(None, sets), tokens_per_sample=64, console=False
    )
    return trainer, trainer.fit()


def test_real_out_of_memory_is_recovered_by_the_ladder(tmp_path):
    import json

    trainer, result = _overflowing_run(tmp_path, 65536)
    assert result.step == 2 and trainer.micro_batch_size < 65536
    records = [json.loads(line) for line in (tmp_path / "65536" / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "out_of_memory"]
    assert events and "out of memory" in events[0]["error"].lower()
    assert {r["global_batch"] for r in records if "loss" in r} == {65536}


def test_auto_micro_batch_probes_the_card(tmp_path):
    trainer, result = _overflowing_run(tmp_path, "auto")
    assert result.step == 2 and 1 <= trainer.micro_batch_size < 65536
    total = torch.cuda.get_device_properties(0).total_memory
    assert result.metrics["memory/peak_reserved_gib"] * 2**30 <= total
