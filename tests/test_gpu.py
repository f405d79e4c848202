"""CUDA paths: run where a GPU is present (skipped elsewhere, see conftest)."""

import numpy as np
import pytest
import torch

from kiln import Trainer
from kiln.config import load_config
from kiln.data import TokenSequences
from kiln.models import GPT, GPTConfig
from kiln.train.lm import lm_loss

pytestmark = pytest.mark.gpu


def _data(tmp_path, vocab=256, n=100_000):
    path = tmp_path / "tokens.bin"
    base = np.tile(np.arange(vocab, dtype=np.uint16), n // vocab + 1)[:n]
    base.tofile(path)
    return TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), 64)


def _fit(tmp_path, precision, **extra):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, d_model=128, n_head=4, n_kv_head=2, d_ff=256,
                          max_seq_len=64, tie_embeddings=True))
    sets = [f"run.dir={tmp_path / precision}", "run.device=cuda", "train.max_steps=40", "train.micro_batch_size=8",
            "train.global_batch_size=16", "train.lr=3e-3", "train.warmup_steps=5", "train.log_every=5",
            f"train.precision={precision}", "data.num_workers=2", "eval.every=0", "checkpoint.every=0"]
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


def test_compile_and_activation_checkpointing_on_cuda(tmp_path):
    _, result = _fit(tmp_path, "bf16", **{"train.compile": "true", "train.activation_checkpointing": "true"})
    assert result.metrics["loss"] < 3.0


def test_flash_attention_kernel_runs():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = GPT(GPTConfig(vocab_size=256, n_layer=2, d_model=128, n_head=4, n_kv_head=2, d_ff=256,
                          max_seq_len=128, tie_embeddings=True)).cuda()
    idx = torch.randint(0, 256, (2, 128), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
        logits.float().sum().backward()
    assert torch.isfinite(logits).all()
