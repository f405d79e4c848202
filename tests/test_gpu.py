"""CUDA paths: run where a GPU is present (skipped elsewhere, see conftest)."""

import json
import warnings

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
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tokens.bin"
    base = np.tile(np.arange(vocab, dtype=np.uint16), n // vocab + 1)[:n]
    base.tofile(path)
    return TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), 64)


TINY = dict(vocab_size=256, n_layer=2, d_model=128, n_head=4, n_kv_head=2, d_ff=256, max_seq_len=64)


def _fit(tmp_path, precision, shape=None, **extra):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, "tie_embeddings": True, **(shape or {})}))
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


def test_a_gpu_run_compiles_after_its_first_eager_steps(tmp_path):
    """What compile = "auto" does on a GPU (tests/train/test_time_plan.py resolves it, on any
    device): some eager steps, then the compile in the middle of the run, which learns on."""
    trainer, result = _fit(tmp_path, "bf16", **{"train.compile": "true", "train.compile_after": "20"})
    assert trainer.train_step.compile_after is None  # compiled
    assert result.metrics["loss"] < 3.0


def test_the_training_step_does_not_wait_for_the_device(tmp_path):
    """Between log points the host only queues work: twenty more steps add no synchronising call
    (torch.cuda.set_sync_debug_mode warns at each one; counted over two runs that differ only in
    their number of steps, so setup and the final log and evaluation cancel out)."""

    def syncs(steps: int) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _fit(tmp_path / str(steps), "bf16", **{"train.max_steps": steps, "train.log_every": 1000})
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in caught)

    assert syncs(40) - syncs(20) <= 1


def test_profile_on_cuda_times_the_device_without_waiting_for_it(tmp_path):
    """On a GPU the profiler's phases are the device's time between CUDA events (a wait at each
    boundary would idle the device), and it says how long the device was busy and idle."""
    _, result = _fit(tmp_path, "bf16", **{"profile.steps": "30:33", "train.compile": "true"})
    breakdown = json.loads((tmp_path / "bf16" / "profile" / "breakdown.json").read_text())
    phases, step = breakdown["phases_ms"], breakdown["step_ms"]
    assert phases["compute"] > phases["optimizer"] > 0 and phases["communication"] == 0
    covered = phases["data wait"] + phases["compute"] + phases["optimizer"]
    assert 0.5 * step < covered <= 1.01 * step
    assert 0 < breakdown["device_busy_ms"] <= 1.01 * step
    assert breakdown["device_idle_ms"] == pytest.approx(step - breakdown["device_busy_ms"])
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


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_muon_trains_on_cuda_with_newton_schulz_in_bf16(tmp_path):
    from kiln.train.optim import orthogonalize

    g = torch.randn(256, 96, device="cuda")
    s = torch.linalg.svdvals(orthogonalize(g).float())
    assert s.min() > 0.5 and s.max() < 1.5
    _, result = _fit(tmp_path, "bf16", **{"train.optimizer": "muon", "train.compile": "true"})
    assert result.metrics["loss"] < 3.0


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="grouped GEMM needs sm_90"
)


@hopper
def test_grouped_mm_on_hopper_equals_a_loop_over_the_experts():
    from kiln.models.gpt.moe import _native_grouped_mm, grouped_mm

    x = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 96, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ends = torch.tensor([100, 100, 700, 1000], device="cuda", dtype=torch.int32)  # expert 1 gets no rows
    assert _native_grouped_mm(x)
    native = grouped_mm(x, w, ends)
    native.float().square().sum().backward()
    grads = x.grad, w.grad
    x.grad = w.grad = None
    loop = grouped_mm(x, w, ends, native=False)
    loop.float().square().sum().backward()
    assert _relative(native, loop) < 1e-2
    assert _relative(grads[0], x.grad) < 1e-2 and _relative(grads[1], w.grad) < 1e-2


@hopper
def test_a_mixture_of_experts_trains_compiled_on_cuda(tmp_path):
    moe = {"n_experts": 4, "experts_per_token": 2, "d_expert": 128}
    _, result = _fit(tmp_path, "bf16", shape=moe, **{"train.compile": "true"})
    assert result.metrics["loss"] < 3.0


def test_context_parallel_attention_runs_the_flash_kernel_lower_right(tmp_path):
    """A context-parallel group of one on one GPU: each chunk's queries attend to the keys up to
    its end through SDPA's lower-right causal mask, which must reach the flash kernel (it is the
    only kernel allowed here) and equal the whole model's plain causal attention."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kiln.distributed.context import apply_cp

    # An earlier test's trainer may have left the process's one-rank group (kiln keeps it).
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        whole = GPT(GPTConfig(**{**TINY, "max_seq_len": 256}, tie_embeddings=True)).cuda()
        split = copy.deepcopy(whole)
        cp_mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))["cp"]
        apply_cp(list(split.blocks), "attn.core", cp_mesh).install(split)
        idx = torch.randint(0, 256, (2, 256), device="cuda")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
            want, got = whole(idx, idx), split(idx, idx)
            want.backward()
            got.backward()
        assert abs(got.item() - want.item()) / want.item() < 1e-3
        for p, q in zip(split.parameters(), whole.parameters(), strict=True):
            assert _relative(p.grad, q.grad) < 2e-2
    finally:
        if own:
            dist.destroy_process_group()


def test_flash_lower_right_attention_with_grouped_keys_equals_repeated_keys():
    """Whether SDPA's lower-right causal mask reaches the flash kernel with ``enable_gqa`` (keys
    and values not repeated for the query heads): what context parallelism would save by it."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = causal_lower_right(128, 384)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        repeated = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), mask)
        try:
            grouped = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        except RuntimeError as e:
            pytest.xfail(f"flash lower-right with enable_gqa: {str(e).splitlines()[0]}")
    assert _relative(grouped, repeated) < 1e-2


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.11 (H200, 2026-11-26): torch.export of the CUDA model fails on a guard it cannot prove, "
    "min(32*seq, 64*seq) == 32*seq; kiln export runs on the CPU, so no kiln command takes this path yet",
)
def test_aoti_package_compiled_for_cuda_equals_the_model(tmp_path):
    from kiln.export.pt2 import write_pt2

    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, tie_embeddings=True)).cuda().eval()
    loaded = write_pt2(model, torch.randint(0, 256, (2, 16), device="cuda"), 64, tmp_path)
    idx = torch.randint(0, 256, (3, 40), device="cuda")
    with torch.no_grad():
        want = model(idx)
        for kind, program in loaded.items():
            assert _relative(program(idx), want) < 1e-3, kind
