"""Pretrained Hugging Face weights read shard by shard under FSDP over two gloo ranks: each rank
allocates and reads only its slices, every tensor named as transformers names it, and the sharded
model computes what ``from_pretrained`` loads, for every architecture and save form of
tests/models/test_hf_loading.py."""

import json

import pytest
import torch

from hf_models import DECODERS, ENCODERS, auto_class, save_tiny, task_of
from kilnrun import free_port, join_as, spawn

pytestmark = pytest.mark.dist

transformers = pytest.importorskip("transformers")

CLASSIFIER = "sequence_classification"
FORMS = {"headed": {}, "headless-sharded-bf16": dict(headless=True, shards=True, dtype=torch.bfloat16)}


def _rank(rank: int, world_size: int, root: str, port: int) -> None:
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    from kiln.config import ModelConfig, ParallelConfig
    from kiln.distributed.parallelize import parallelize
    from kiln.distributed.world import close_world, init_world
    from kiln.models.hf import FAMILY
    from kiln.models.init import params_on_meta

    join_as(rank, world_size, port)
    pcfg = ParallelConfig(strategy="fsdp")
    world = init_world("cpu", pcfg)
    try:
        cases = json.loads((Path(root) / "cases.json").read_text())
        ids = torch.load(Path(root) / "ids.pt")
        for case in cases:
            task = case["task"]
            args = FAMILY.resolve(ModelConfig(source=f"hf:{case['dir']}", task=task), vocab_size=0, seq_len=32)
            if task == CLASSIFIER:
                args = args.__class__(**{**args.__dict__, "labels": ("a", "b")})
            with params_on_meta():
                model = FAMILY.build(args)
            values = FAMILY.initial_values(args, model, 0)
            parallel = parallelize(model, FAMILY.parallel_plan(args), world, pcfg, initial=values)
            local = [p for p in parallel.module.parameters() if isinstance(p, DTensor)]
            assert local and all(p.to_local().numel() < p.numel() for p in local if p.shape[0] > 1), case["dir"]
            with torch.no_grad():
                logits = parallel.module.eval()(ids)
            want = torch.load(Path(case["dir"]) / "logits.pt")
            # A headless classifier's new head is kiln's own (from the seed): the reference was given it.
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6, msg=lambda m, c=case: f"{c['dir']}: {m}")
    finally:
        close_world()


@pytest.mark.slow
def test_fsdp_ranks_read_their_shards_of_every_architecture_as_from_pretrained_loads(tmp_path):
    from kiln.config import ModelConfig
    from kiln.models.hf import FAMILY

    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    cases = []
    for model_type in [*ENCODERS, *DECODERS]:
        task = task_of(model_type)
        for form, save in FORMS.items():
            tie = {"tie_word_embeddings": True} if save.get("headless") and task == "causal_lm" else {}
            directory = save_tiny(tmp_path / f"{model_type}-{form}", model_type, **save, **tie)
            extra = {"num_labels": 2} if task == CLASSIFIER else {}
            reference = auto_class(task).from_pretrained(directory, dtype=torch.float32, **extra).eval()
            if task == CLASSIFIER and save.get("headless"):
                # The head kiln starts from its seed, as one process makes it.
                args = FAMILY.resolve(ModelConfig(source=f"hf:{directory}", task=task), vocab_size=0, seq_len=32)
                args = args.__class__(**{**args.__dict__, "labels": ("a", "b")})
                ours = FAMILY.create(args, "cpu", 0).hf.state_dict()
                prefix = reference.base_model_prefix
                reference.load_state_dict(
                    {k: ours[k] for k in reference.state_dict() if not k.startswith(f"{prefix}.")}, strict=False
                )
            with torch.no_grad():
                torch.save(reference(ids).logits, directory / "logits.pt")
            cases.append({"dir": str(directory), "task": task})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    spawn(_rank, (2, str(tmp_path), free_port()), 2)
