"""Environment checks of ``kiln doctor``: versions, the device and its features, disk space.

Each check takes the doctor's Subject (job.py) and returns (status, evidence, fix)."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.doctor.job import Subject
from kiln.doctor.report import first_line, fmt_bytes
from kiln.train.optim import build_optimizer

# A checkpoint holds fp32 weights and AdamW's two moments (12 bytes per parameter), rounded up
# for the training state and file overheads.
CHECKPOINT_BYTES_PER_PARAM = 16


def check_versions(job: Subject):
    import numpy
    import tokenizers

    threads = torch.get_num_threads()
    evidence = (
        f"Python {platform.python_version()}, PyTorch {torch.__version__}, numpy {numpy.__version__}, "
        f"tokenizers {tokenizers.__version__} on {platform.system()} {platform.machine()}; "
        f"{os.cpu_count()} CPU cores, PyTorch uses {threads} threads"
    )
    return "pass", evidence, ""


def check_device(job: Subject):
    runtime = torch.version.cuda
    driver = _driver_cuda_version()
    if job.device_problem:
        why = _why_no_cuda(runtime, driver)
        return (
            "fail",
            f"{job.device_problem} ({why}); the checks below ran on the CPU, the model's were skipped",
            _cuda_fix(runtime, driver),
        )
    if not torch.cuda.is_available():
        if runtime is not None:
            return (
                "warn",
                f"PyTorch is built for CUDA {runtime} but {_why_no_cuda(runtime, driver)}: training runs on the CPU",
                _cuda_fix(runtime, driver),
            )
        if driver:
            return (
                "warn",
                f"an NVIDIA driver is installed (supports CUDA {_v(driver)}) but PyTorch "
                f"{torch.__version__} is a CPU-only build: training runs on the CPU",
                "install a CUDA build of PyTorch (see pytorch.org for the pip command matching your driver)",
            )
        return "pass", f"no GPU: training on the CPU (PyTorch {torch.__version__} is a CPU build)", ""
    devices = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    described = "; ".join(f"cuda:{i} {p.name} ({_arch(p)}, {fmt_bytes(p.total_memory)})" for i, p in enumerate(devices))
    if runtime is None:  # a ROCm build: HIP stands in for CUDA, with its own architectures
        stack = f"ROCm {getattr(torch.version, 'hip', '?')}"
    else:
        stack = (
            f"CUDA runtime {runtime}, driver supports {_v(driver) if driver else 'unknown'}, "
            f"cuDNN {torch.backends.cudnn.version()}, NCCL {_nccl_version()}"
        )
    evidence = f"{stack}; {described}; training on {job.device}"
    arch_list = torch.cuda.get_arch_list()
    unsupported = [
        f"cuda:{i} ({_arch(p)})"
        for i, p in enumerate(devices)
        if runtime is not None and arch_list and not _has_kernels(p.major, p.minor, arch_list)
    ]
    if unsupported:
        return (
            "fail",
            f"{evidence}. This PyTorch has no kernels for {', '.join(unsupported)} (built for {' '.join(arch_list)})",
            "install a PyTorch build that supports this GPU generation (a newer release or CUDA version)",
        )
    if job.device.type == "cpu":
        return "warn", f"{evidence} although a GPU is available", "set run.device=auto (or cuda) to train on the GPU"
    return "pass", evidence, ""


def check_bf16(job: Subject):
    wanted = job.cfg.train.precision == "bf16"
    if job.device.type == "cuda":
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # older PyTorch has no emulation flag
            native = torch.cuda.is_bf16_supported()
        if native:
            name = torch.cuda.get_device_name(job.device)
            return "pass", f"bf16 is native on {name} (train.precision={job.cfg.train.precision})", ""
        status = "fail" if wanted else "pass"
        return (
            status,
            f"{torch.cuda.get_device_name(job.device)} has no native bf16 (compute capability below 8.0)",
            "set train.precision=fp16 (autocast with a loss scaler) or fp32" if wanted else "",
        )
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(4, 4) @ torch.ones(4, 4)
    except RuntimeError as e:
        return (
            "fail" if wanted else "pass",
            f"bf16 autocast does not run on this CPU: {first_line(e)}",
            "set train.precision=fp32" if wanted else "",
        )
    return (
        "pass",
        f"bf16 autocast runs on the CPU (vector ISA {torch.backends.cpu.get_cpu_capability()}); it is "
        f"faster than fp32 only on CPUs with native bf16 (AMX, AVX512-BF16); train.precision="
        f"{job.cfg.train.precision}",
        "",
    )


def check_flash_attention(job: Subject):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, precision = job.device, job.cfg.train.precision
    # The flash kernel on a GPU takes half precision only; on the CPU it also takes fp32.
    if device.type == "cuda":
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    head_dim = job.head_dim or 64
    q = torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        evidence = (
            f"the SDPA flash kernel does not run on {device} for {dtype} with head_dim {head_dim}: {first_line(e)}"
        )
        if device.type == "cuda":
            return (
                "warn",
                evidence,
                (
                    "attention falls back to slower kernels; flash needs an Ampere or newer GPU, "
                    "bf16/fp16 and a head_dim of at most 256 (a multiple of 8)"
                ),
            )
        return "pass", evidence + "; the CPU uses the math kernel", ""
    note = ""
    if device.type == "cuda" and precision == "fp32":
        note = "; train.precision=fp32 keeps attention off it (bf16 turns it on)"
    return "pass", f"the SDPA flash kernel runs on {device} ({dtype}, head_dim {head_dim}){note}", ""


def check_fused_adamw(job: Subject):
    device = job.device
    param = torch.nn.Parameter(torch.zeros(8, device=device))
    try:
        fused = torch.optim.AdamW([param], fused=True)
        param.grad = torch.ones_like(param)
        fused.step()
    except (RuntimeError, ValueError) as e:
        available = f"the fused AdamW kernel does not run on {device}: {first_line(e)}"
    else:
        available = f"the fused AdamW kernel runs on {device}"
    # What kiln's own optimizer does on this device, tried the same way.
    module = torch.nn.Linear(4, 4, device=device)
    try:
        optimizer = build_optimizer(module, job.cfg.train, device)
        module(torch.ones(2, 4, device=device)).sum().backward()
        optimizer.step()
    except (RuntimeError, ValueError) as e:
        return (
            "fail",
            f"{available}; kiln's optimizer fails on {device}: {first_line(e)}",
            "upgrade PyTorch (fused AdamW needs 2.4 or newer on the CPU), or train on another device",
        )
    used = "uses it" if optimizer.defaults.get("fused") else "uses the foreach implementation here"
    return "pass", f"{available}; kiln's optimizer {used}", ""


def check_disk(job: Subject):
    run_dir = Path(job.cfg.run.dir).expanduser().absolute()
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    one = job.num_params * CHECKPOINT_BYTES_PER_PARAM
    keep = job.cfg.checkpoint.keep
    # A save writes the new checkpoint before it deletes the oldest: keep + 1 exist for a moment.
    needed = one * (keep + 1)
    evidence = (
        f"{fmt_bytes(free)} free at {existing}; a checkpoint is about {fmt_bytes(one)} "
        f"({job.num_params:,} parameters x {CHECKPOINT_BYTES_PER_PARAM} bytes), checkpoint.keep={keep} "
        f"needs {fmt_bytes(needed)} while saving"
    )
    if free < one:
        return "fail", evidence + ": not even one checkpoint fits", "free disk space or point run.dir at a larger disk"
    if free < 2 * needed:
        return (
            "warn",
            evidence + ": less than twice that is free",
            "free disk space, point run.dir at a larger disk, or lower checkpoint.keep",
        )
    return "pass", evidence, ""


CHECKS = [
    ("environment", "python & pytorch", check_versions),
    ("environment", "device & CUDA", check_device),
    ("environment", "bf16", check_bf16),
    ("environment", "flash attention", check_flash_attention),
    ("environment", "fused AdamW", check_fused_adamw),
    ("environment", "disk space", check_disk),
]


# -- helpers --------------------------------------------------------------------------------------


def _driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed NVIDIA driver supports, asked of the driver library
    itself (so it works even where PyTorch cannot use CUDA), or None without a driver."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so", "libcuda.dylib")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return version.value // 1000, version.value % 1000 // 10
    return None


def _v(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _why_no_cuda(runtime: str | None, driver: tuple[int, int] | None) -> str:
    if runtime is None:
        return f"PyTorch {torch.__version__} is a CPU-only build"
    if driver is None:
        return "no NVIDIA driver was found (libcuda)"
    if driver[0] < int(runtime.split(".")[0]):
        return f"the driver supports CUDA up to {_v(driver)}, older than PyTorch's CUDA {runtime}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return "CUDA_VISIBLE_DEVICES is empty"
    return f"CUDA did not initialise (driver supports {_v(driver)})"


def _cuda_fix(runtime: str | None, driver: tuple[int, int] | None) -> str:
    if runtime is None:
        return "install a CUDA build of PyTorch, or set run.device=cpu (or auto)"
    if driver is None:
        return "install the NVIDIA driver (nvidia-smi should list the GPU), or set run.device=cpu"
    if driver[0] < int(runtime.split(".")[0]):
        return f"update the NVIDIA driver, or install a PyTorch build for CUDA {driver[0]}.x"
    return "check that nvidia-smi lists the GPU and CUDA_VISIBLE_DEVICES, or set run.device=cpu"


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return "unavailable"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _arch(props) -> str:
    return f"sm_{props.major}{props.minor}"


def _has_kernels(major: int, minor: int, arch_list: list[str]) -> bool:
    """Does this PyTorch carry machine code for the capability (same major, not newer minor), or
    PTX that the driver can compile for it (any older capability)?"""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        if not number.isdigit():
            continue
        a_major, a_minor = int(number) // 10, int(number) % 10
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False
