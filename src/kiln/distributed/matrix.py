"""Which feature runs under which layout: the table of docs/distributed.md, made from the checks
a run makes before it starts (``Config.errors`` and ``parallelize.check_layout``), so that it
says what kiln does and cannot drift from it (tests/distributed/test_matrix.py regenerates it and
fails when the doc disagrees).

A cell is a run's config: the feature's settings on top of the layout's, on the model the feature
trains (kiln's GPT, or a Hugging Face Llama; under expert parallelism, their mixtures of experts:
kiln's preset, a Qwen3-MoE). It is "✓" with the test that shows that layout computing what one process computes, or
"runs" where no test shows it yet, or the first reason a run of it is refused, as the run says it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.config import Config, ConfigError, ParallelConfig, from_dict

if TYPE_CHECKING:
    from kiln.models.family import ParallelPlan


@dataclass(frozen=True)
class Layout:
    name: str
    world: int  # ranks
    parallel: Mapping[str, Any]


LAYOUTS = (
    Layout("DDP", 2, {"strategy": "ddp"}),
    Layout("FSDP", 2, {"strategy": "fsdp"}),
    Layout("HSDP", 4, {"strategy": "fsdp", "dp_replicate": 2}),
    Layout("TP", 2, {"tp": 2}),
    Layout("PP", 2, {"pp": 2}),
    Layout("EP", 2, {"strategy": "fsdp", "ep": 2}),
    Layout("CP", 2, {"cp": 2}),
)
_HF = {"model": {"source": "hf:LLAMA"}, "data": {"source": "records.jsonl"}}
_MOE = {"model": {"preset": "tiny-moe"}}
# Each feature as the settings a user gives; the model a layout trains it on follows from them.
FEATURES: dict[str, dict[str, dict[str, Any]]] = {
    "AdamW": {},
    "Muon": {"train": {"optimizer": "muon"}},
    "bf16": {"train": {"precision": "bf16"}},
    "fp16": {"train": {"precision": "fp16"}},
    "fp8": {"train": {"precision": "fp8"}},
    "compile": {"train": {"compile": True}},
    "activation checkpointing": {"train": {"activation_checkpointing": True}},
    "LoRA": {"lora": {"rank": 8}},
    "QLoRA": {**_HF, "lora": {"rank": 8, "quantize_base": "nf4"}},
    "qk_norm": {"model": {"qk_norm": "true"}},
    "MoE": _MOE,
    "packing": {**_HF, "data": {"source": "records.jsonl", "packing": True}},
    "document mask": {"data": {"document_mask": True}},
    "SFT": _HF,
    "DPO family": {**_HF, "run": {"job": "dpo"}},
    "GRPO": {**_HF, "run": {"job": "grpo"}, "grpo": {"reward": "rewards:exact"}},
    "eval.tasks": {"eval": {"tasks": ["hellaswag"]}},
    "HF models": _HF,
}
# Where a combination that runs is shown to compute what one process computes.
_PARALLEL = "tests/distributed/test_parallel.py::"
_EXPERTS = "tests/distributed/test_moe_ranks.py::"
_CP = "tests/distributed/test_context_ranks.py::"
_QK = "tests/models/test_qk_norm.py::test_qk_norm_on_two_ranks_trains_as_one_process"
_MUON = "tests/train/test_muon.py::test_muon_on_two_ranks_trains_as_one_process"
_SFT = "tests/train/test_finetune.py::test_two_ranks_equal_one_process"
_HF_CP = "tests/train/test_finetune.py::test_llama_class_models_split_their_sequences_over_two_context_parallel_ranks"
_HF_PP = "tests/train/test_finetune.py::test_llama_class_models_split_into_two_pipeline_stages"
_HF_EP = "tests/train/test_hf_moe.py::test_experts_split_over_two_ranks_train_as_one_process_and_export"
_HF_EP_OBJECTIVES = (
    "tests/train/test_hf_moe.py::test_objectives_and_adapters_with_experts_split_over_two_ranks_equal_one_process"
)
_DPO = "tests/train/test_preference_objectives.py::test_dpo_on_two_ranks_equals_one_process"
_GRPO = "tests/train/test_grpo.py::test_grpo_on_two_ranks_samples_and_trains_as_one_process"
_HSDP_SFT = "tests/train/test_finetune.py::test_hsdp_trains_packed_records_as_one_process"
_TASKS = "tests/harness/test_tasks_in_training.py::test_task_scores_on_two_ranks_are_those_of_the_saved_model"
PROOFS: dict[tuple[str, str], str] = {
    ("AdamW", "DDP"): _PARALLEL + "test_ddp_two_ranks_equal_one_process_with_twice_the_micro_batch",
    ("AdamW", "FSDP"): _PARALLEL + "test_fsdp_equals_one_process_and_saves_a_shard_per_rank",
    ("AdamW", "HSDP"): "tests/distributed/test_world.py::test_hsdp_two_replicas_of_two_shards_equal_one_process",
    ("AdamW", "TP"): _PARALLEL + "test_sharded_strategies_equal_one_process",
    ("compile", "TP"): _PARALLEL + "test_sharded_strategies_equal_one_process",
    ("AdamW", "PP"): "tests/distributed/test_pipeline.py::test_two_stages_train_as_one_process",
    ("AdamW", "EP"): _EXPERTS + "test_experts_split_over_two_ranks_train_as_one_process",
    ("AdamW", "CP"): _CP + "test_two_ranks_splitting_each_sequence_train_as_one_process",
    ("Muon", "DDP"): _MUON,
    ("Muon", "FSDP"): _MUON,
    ("Muon", "TP"): _MUON,
    ("Muon", "HSDP"): _MUON,
    ("bf16", "HSDP"): _PARALLEL + "test_fsdp_bf16_computes_in_bf16_and_keeps_fp32_weights",
    ("qk_norm", "HSDP"): _QK,
    ("MoE", "HSDP"): _EXPERTS + "test_a_mixture_of_experts_on_two_fsdp_ranks_equals_one_process",
    ("LoRA", "HSDP"): (
        "tests/train/test_lora.py::test_fsdp_lora_in_bf16_keeps_a_bf16_base_trains_as_one_process_and_resumes_exactly"
    ),
    ("QLoRA", "HSDP"): (
        "tests/train/test_qlora.py::test_two_fsdp_ranks_share_the_4_bit_base_and_give_the_losses_of_one_process"
    ),
    ("document mask", "HSDP"): (
        _CP + "test_packed_documents_split_over_two_ranks_and_into_pipeline_stages_train_as_one_process"
    ),
    ("SFT", "HSDP"): _HSDP_SFT,
    ("HF models", "HSDP"): _HSDP_SFT,
    ("packing", "HSDP"): _HSDP_SFT,
    ("DPO family", "HSDP"): _DPO,
    ("GRPO", "DDP"): _GRPO,
    ("GRPO", "FSDP"): _GRPO,
    ("GRPO", "TP"): _GRPO,
    ("GRPO", "PP"): _GRPO,
    ("GRPO", "CP"): _GRPO,
    (
        "GRPO",
        "EP",
    ): "tests/train/test_grpo.py::test_grpo_with_experts_split_over_two_ranks_samples_and_trains_as_one_process",
    ("eval.tasks", "HSDP"): _TASKS,
    ("fp16", "PP"): "tests/distributed/test_pipeline.py::test_fp16_in_two_stages_trains_as_one_process",
    ("bf16", "FSDP"): _PARALLEL + "test_fsdp_bf16_computes_in_bf16_and_keeps_fp32_weights",
    ("qk_norm", "FSDP"): _QK,
    ("qk_norm", "TP"): _QK,
    ("MoE", "FSDP"): _EXPERTS + "test_a_mixture_of_experts_on_two_fsdp_ranks_equals_one_process",
    ("MoE", "PP"): _EXPERTS + "test_experts_split_over_two_ranks_in_each_pipeline_stage_train_as_one_process",
    ("MoE", "EP"): _EXPERTS + "test_experts_split_over_two_ranks_train_as_one_process",
    ("MoE", "CP"): _EXPERTS + "test_experts_split_over_the_context_parallel_ranks_train_as_one_process",
    ("SFT", "DDP"): _SFT,
    ("SFT", "FSDP"): _SFT,
    ("SFT", "TP"): "tests/train/test_finetune.py::test_llama_class_models_split_over_two_tensor_parallel_ranks",
    ("HF models", "DDP"): _SFT,
    ("HF models", "FSDP"): _SFT,
    ("HF models", "TP"): "tests/train/test_finetune.py::test_llama_class_models_split_over_two_tensor_parallel_ranks",
    ("QLoRA", "DDP"): "tests/train/test_qlora.py::test_two_ddp_ranks_give_the_losses_of_one_process",
    ("QLoRA", "FSDP"): (
        "tests/train/test_qlora.py::test_two_fsdp_ranks_share_the_4_bit_base_and_give_the_losses_of_one_process"
    ),
    ("LoRA", "FSDP"): (
        "tests/train/test_lora.py::test_fsdp_lora_in_bf16_keeps_a_bf16_base_trains_as_one_process_and_resumes_exactly"
    ),
    ("LoRA", "TP"): "tests/train/test_lora.py::test_lora_on_two_tensor_parallel_ranks_trains_as_one_process",
    ("fp8", "TP"): "tests/train/test_fp8.py::test_fp8_on_two_tensor_parallel_ranks_trains_as_one_process",
    (
        "document mask",
        "PP",
    ): "tests/distributed/test_pipeline.py::test_packed_documents_in_two_stages_train_as_one_process",
    ("document mask", "CP"): (
        _CP + "test_packed_documents_split_over_two_ranks_and_into_pipeline_stages_train_as_one_process"
    ),
    ("eval.tasks", "FSDP"): _TASKS,
    ("eval.tasks", "CP"): _TASKS,
    ("eval.tasks", "TP"): _TASKS,
    ("HF models", "EP"): _HF_EP,
    ("SFT", "EP"): _HF_EP,
    ("packing", "EP"): _HF_EP,
    ("QLoRA", "EP"): _HF_EP_OBJECTIVES,
    ("DPO family", "EP"): _HF_EP_OBJECTIVES,
    ("eval.tasks", "PP"): _TASKS,
    ("DPO family", "DDP"): _DPO,
    ("DPO family", "CP"): _DPO,
    ("HF models", "CP"): _HF_CP,
    ("SFT", "CP"): _HF_CP,
    ("packing", "CP"): _HF_CP,
    ("DPO family", "FSDP"): _DPO,
    ("DPO family", "TP"): _DPO,
    ("HF models", "PP"): _HF_PP,
    ("DPO family", "PP"): _DPO,
    ("SFT", "PP"): _HF_PP,
    ("packing", "PP"): _HF_PP,
    (
        "QLoRA",
        "PP",
    ): "tests/train/test_qlora.py::test_two_pipeline_stages_give_the_losses_of_one_process_and_resume_exactly",
}


def _merged(*parts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for section, values in part.items():
            out.setdefault(section, {}).update(values)
    return out


def refusal(feature: str, layout: Layout) -> str | None:
    """Why a run of ``feature`` under ``layout`` is refused before it starts (its first reason, as
    the run says it), or None if it runs."""
    from kiln.distributed.parallelize import check_layout
    from kiln.distributed.world import World, mesh_dims

    settings = FEATURES[feature]
    model = _MOE if layout.name == "EP" and "source" not in settings.get("model", {}) else {}
    values = _merged(model, settings, {"parallel": layout.parallel})
    try:
        cfg = from_dict(values)
    except ConfigError as e:
        return e.errors[0]
    errors = cfg.errors()
    if errors:
        return errors[0]
    pcfg: ParallelConfig = cfg.parallel
    dims = mesh_dims(layout.world, pcfg)
    world = World(size=layout.world, tp=dims["tp"], pp=dims["pp"], cp=dims["cp"], dp_replicate=dims["dp_replicate"])
    try:
        check_layout(_plan(cfg), world, pcfg, _model_name(cfg))
    except ConfigError as e:
        return e.errors[0]
    return None


def _plan(cfg: Config) -> ParallelPlan:
    """The parallel plan of the model ``cfg`` trains (a tiny Llama for a Hugging Face source)."""
    from kiln.models.family import family_of

    if cfg.model.source:
        from kiln.models.hf import FAMILY, HFArgs

        transformers = __import__("transformers")
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        if cfg.parallel.ep > 1:  # a mixture of experts, whose experts expert parallelism splits
            config = transformers.Qwen3MoeConfig(**dims, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        else:
            config = transformers.LlamaConfig(**dims, intermediate_size=128)
        return FAMILY.parallel_plan(HFArgs(_model_name(cfg), cfg.model.task, config.to_dict()))
    family = family_of(cfg.model)
    return family.parallel_plan(family.resolve(cfg.model, vocab_size=512, seq_len=cfg.data.seq_len))


def _model_name(cfg: Config) -> str:
    if not cfg.model.source:
        return "GPT"
    return "Qwen3MoeForCausalLM" if cfg.parallel.ep > 1 else "LlamaForCausalLM"


def table() -> str:
    """The feature x layout table (Markdown)."""
    head = "| feature | " + " | ".join(layout.name for layout in LAYOUTS) + " |"
    rule = "|---|" + "---|" * len(LAYOUTS)
    rows = [head, rule]
    for feature in FEATURES:
        cells = []
        for layout in LAYOUTS:
            why = refusal(feature, layout)
            if why is None:
                proof = PROOFS.get((feature, layout.name))
                cells.append(f"✓ `{proof.split('::')[1]}`" if proof else "runs; not yet tested equal to one process")
            else:
                cells.append("✗ " + why.replace("|", "\\|"))
        rows.append(f"| {feature} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
