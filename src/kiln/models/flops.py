"""Training FLOPs per token, and accelerators' peak throughput, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

from kiln.models.gpt import GPTConfig
from kiln.models.presets import param_count

# Dense (no sparsity) bf16 tensor-core peak per device, in FLOP/s, from the vendors' datasheets.
# Matched as substrings of torch.cuda.get_device_name(), longest first ("H100 PCIe" before "H100").
PEAK_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
}


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, in the PaLM / nanoGPT convention::

        6 * N + 12 * n_layer * d_model * seq_len

    N counts the parameters of every matmul a token goes through: the attention and MLP
    projections of each layer and the lm_head (tied or not); not the input embedding (a lookup)
    nor the norms' gains. Each such weight costs 2 FLOPs per token forward (multiply and add) and
    4 backward (gradients of input and weight): 6 * N. The second term is attention itself,
    QK^T and AV, 2 * 2 * d_model * seq_len per layer forward, times 3 with the backward;
    the causal mask's skipped half is counted too, as is conventional.
    """
    norm_gains = (2 * cfg.n_layer + 1) * cfg.d_model
    # A tied matrix is counted once, as the lm_head's; an untied input embedding is only a lookup.
    input_embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    n_matmul = param_count(cfg) - norm_gains - input_embedding
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


def gpu_key(name: str) -> str | None:
    """The PEAK_FLOPS entry a GPU name ("NVIDIA H100 80GB HBM3", "h100") falls under: the longest
    key it contains, case aside; None for a GPU not in the table."""
    lowered = name.strip().lower()
    return next((key for key in sorted(PEAK_FLOPS, key=len, reverse=True) if key.lower() in lowered), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None on CPU and on accelerators not in PEAK_FLOPS."""
    if device.type != "cuda":
        return None
    key = gpu_key(torch.cuda.get_device_name(device))
    return PEAK_FLOPS[key] if key else None
