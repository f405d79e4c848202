"""kiln plan against torchtitan's published Llama 3 runs (docs/plan.md, "Checked against published
runs"): each run planned with its own settings (selective or full checkpointing, torch.compile,
tensor parallelism with sequence and loss parallelism, float8, a pipeline of unequal stages)
gives tokens per second per GPU within 15% of the published figure."""

import pytest

from kiln.config import load_config
from kiln.plan import make_plan

LLAMA3 = ["data.vocab_size=128256", "data.seq_len=8192", "parallel.strategy=fsdp"]
H100 = {"gpu": "h100", "device_memory": "96GB", "gpus_per_node": 8}
A100 = {"gpu": "a100", "device_memory": "80GB", "gpus_per_node": 8}


def run(preset: str, local: int, world: int, checkpointing: str, compiled: bool, **parallel) -> list[str]:
    data = world // (parallel.get("tp", 1) * parallel.get("pp", 1))
    items = [f"model.preset={preset}", *LLAMA3, f"train.micro_batch_size={local}"]
    items += [f"train.global_batch_size={local * data}", f"train.activation_checkpointing={checkpointing}"]
    items += [f"train.compile={str(compiled).lower()}"]
    return items + [f"parallel.{key}={value}" for key, value in parallel.items()]


# (run, hardware and nodes, torchtitan's tokens/s per GPU)
RUNS = {
    "8B, 8 H100, FSDP, selective, eager": (run("llama3-8b", 2, 8, "selective", False), H100, 1, 5762),
    "8B, 8 H100, FSDP, selective, compile": (run("llama3-8b", 2, 8, "selective", True), H100, 1, 6667),
    "8B, 128 H100, FSDP, selective, eager": (run("llama3-8b", 2, 128, "selective", False), H100, 16, 5605),
    "8B, 64 H100, FSDP 8 x TP 8, selective, compile": (
        run("llama3-8b", 12, 64, "selective", True, tp=8),
        H100,
        8,
        4378,
    ),
    "70B, 256 H100, FSDP 32 x TP 8, full, compile": (run("llama3-70b", 16, 256, "true", True, tp=8), H100, 32, 597),
    "405B, 128 H100, FSDP 16 x TP 8, full, compile": (run("llama3-405b", 2, 128, "true", True, tp=8), H100, 16, 109),
    "405B, 512 H100, FSDP 8 x TP 8 x PP 8, full, float8, compile": (
        [
            *run("llama3-405b", 32, 512, "true", True, tp=8, pp=8, pp_microbatches=32),
            "parallel.pp_layers=[15,16,16,16,16,16,16,15]",
            "train.precision=fp8",
        ],
        H100,
        64,
        100,
    ),
    "8B, 64 A100, FSDP, selective, eager": (run("llama3-8b", 1, 64, "selective", False), A100, 8, 2973),
    "70B, 64 A100, FSDP, full, eager": (run("llama3-70b", 1, 64, "true", False), A100, 8, 331),
}


@pytest.mark.parametrize("name", RUNS)
def test_published_runs_are_planned_within_15_percent(name):
    items, hardware, nodes, published = RUNS[name]
    plan = make_plan(load_config(None, items), nodes=nodes, **hardware)
    s, job = plan.base, plan.job
    tokens_per_gpu = job.global_batch * job.seq_len / plan.time.total / s.world_size
    assert tokens_per_gpu == pytest.approx(published, rel=0.15), (name, tokens_per_gpu)
