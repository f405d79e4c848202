"""Preference objectives: kiln's DPO, IPO and SimPO losses equal TRL's on the same model and
pairs; DPO starts at exactly ln 2; the gradient is the same whatever the accumulation and the
number of ranks; a tiny Llama learns a learnable preference, with LoRA's reference costing no
second copy of the model."""

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.config import load_config
from kiln.data.finetune import Examples
from kiln.data.preference import PairCollate, preference_row, prepare_preference
from kiln.data.records import Record
from kiln.distributed.world import World
from kiln.models.hf import CausalLM
from kiln.train.preference import Precomputed, PreferenceLoss, pair_logps
from kiln.train.trainer import train

from conftest import ft_sets, write_jsonl
from grad_probe import assert_same_gradients_three_ways
from kilnrun import kill_and_resume, launch, losses, records, sets

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")
TESTS = Path(__file__).parents[1]


def preference_records(n: int, seed: int = 0) -> list[dict]:
    """Sums: the chosen completion is the right total and ends with "ok", the rejected one a wrong
    total, without it and of varying length: a rule a model can learn to prefer (its form at
    once, its arithmetic slowly)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        terms = [rng.randint(0, 30) for _ in range(rng.randint(2, 4))]
        right = sum(terms)
        wrong = right + rng.choice([-11, -3, 2, 7, 13])
        out.append(
            {
                "prompt": " + ".join(map(str, terms)) + " =",
                "chosen": f" {right} ok",
                "rejected": f" {wrong}" + " so" * rng.randint(0, 2),
            }
        )
    return out


def pref_sets(run_dir, source, model_dir, **extra) -> list[str]:
    items = {"data__seq_len": 48, "run__job": "dpo", "train__max_steps": 4, "train__lr": 1e-3}
    items.update({"train__warmup_steps": 0, "checkpoint__every": 0})
    return ft_sets(run_dir, source, model_dir, **(items | extra))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pref") / "pairs.jsonl", preference_records(64))


# -- the losses against TRL's -------------------------------------------------------------------


def _trl_loss(trainer_class, config_class, policy, ref, tokenizer, records, tmp_path, **config) -> torch.Tensor:
    from datasets import Dataset

    args = config_class(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,  # the default where bf16 runs, which would autocast TRL's reference model
        per_device_train_batch_size=len(records),
        max_length=48,
        **config,
    )
    kwargs = {"ref_model": ref} if ref is not None else {}
    trainer = trainer_class(
        model=policy, args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(records), **kwargs
    )
    trainer.model.eval()
    batch = next(iter(trainer.get_train_dataloader()))
    if hasattr(trainer, "get_batch_loss_metrics"):  # CPOTrainer
        loss, _ = trainer.get_batch_loss_metrics(trainer.model, batch)
        return loss.detach()
    return trainer.compute_loss(trainer.model, batch).detach()


def _kiln_loss(objective, policy, ref, tokenizer, records, tmp_path, **preference) -> torch.Tensor:
    sets = [f"run.job={objective}", *(f"preference.{k}={v}" for k, v in preference.items())]
    cfg = load_config(None, sets)
    rows = [
        preference_row(Record(r, Path("pairs.jsonl"), i + 1), tokenizer, 48)[0] | {"index": i}
        for i, r in enumerate(records)
    ]
    collate = PairCollate(tokenizer)
    reference = None
    if ref is not None:
        reference = Precomputed(tmp_path / "ref", {}, {"train": Examples(rows)}, collate, len(rows), World())
        (tmp_path / "ref").mkdir()
        reference.logps(CausalLM(ref).eval(), collate(rows), "train")  # the table, from the reference model
    loss = PreferenceLoss(cfg, reference)
    with torch.no_grad():
        return loss(CausalLM(policy).eval(), collate(rows))


def _moved_away(model_dir):
    """The tokenizer, the model as the reference, and a copy of it moved away by random noise as
    the policy (so that a loss is not its trivial value at the reference)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return tokenizer, ref, policy


@pytest.mark.parametrize(
    ("objective", "trl_config", "preference"),
    [
        ("dpo", {"loss_type": ["sigmoid"], "beta": 0.1}, {"beta": 0.1}),
        ("dpo", {"loss_type": ["hinge"], "beta": 0.3}, {"beta": 0.3, "loss_type": "hinge"}),
        (
            "dpo",
            {"loss_type": ["robust"], "beta": 0.2, "label_smoothing": 0.1},
            {"beta": 0.2, "loss_type": "robust", "label_smoothing": 0.1},
        ),
        ("ipo", {"loss_type": ["ipo"], "beta": 0.5}, {"beta": 0.5}),
    ],
)
def test_dpo_and_ipo_equal_trl(tmp_path, hf_llama, objective, trl_config, preference):
    from trl import DPOConfig, DPOTrainer

    tokenizer, ref, policy = _moved_away(hf_llama)
    records = preference_records(6, seed=1)
    theirs = _trl_loss(
        DPOTrainer, DPOConfig, copy.deepcopy(policy), copy.deepcopy(ref), tokenizer, records, tmp_path, **trl_config
    )
    ours = _kiln_loss(objective, policy, ref, tokenizer, records, tmp_path, **preference)
    assert abs(theirs.item() - math.log(2)) > 1e-3  # not the trivial value
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-5)


def test_simpo_equals_trl_cpo_with_simpo_loss(tmp_path, hf_llama):
    cpo = pytest.importorskip("trl.experimental.cpo")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_llama)
    policy = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
    records = preference_records(6, seed=2)
    theirs = _trl_loss(
        cpo.CPOTrainer,
        cpo.CPOConfig,
        copy.deepcopy(policy),
        None,
        tokenizer,
        records,
        tmp_path,
        loss_type="simpo",
        cpo_alpha=0.0,
        beta=2.0,
        simpo_gamma=0.5,
    )
    ours = _kiln_loss("simpo", policy, None, tokenizer, records, tmp_path, beta=2.0, gamma=0.5)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-5)


def test_orpo_is_the_chosen_likelihood_and_trls_odds_ratio_term(tmp_path, hf_llama):
    # TRL's ORPOTrainer takes its likelihood term over the prompt's tokens too; kiln, as the paper,
    # over the chosen completion's (per pair, so exact under accumulation). The odds-ratio term is
    # TRL's own function, given the per-token mean log-probabilities (which equal TRL's).
    orpo = pytest.importorskip("trl.experimental.orpo")
    from datasets import Dataset

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_llama)
    policy = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
    records = preference_records(6, seed=4)
    args = orpo.ORPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, beta=0.25)
    trainer = orpo.ORPOTrainer(
        model=copy.deepcopy(policy), args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(records)
    )
    ours = _kiln_loss("orpo", policy, None, tokenizer, records, tmp_path, beta=0.25)
    rows = [
        preference_row(Record(r, Path("p.jsonl"), i + 1), tokenizer, 48)[0] | {"index": i}
        for i, r in enumerate(records)
    ]
    with torch.no_grad():
        chosen, rejected, n_chosen, n_rejected = pair_logps(CausalLM(policy).eval(), PairCollate(tokenizer)(rows))
    mean_chosen, mean_rejected = chosen / n_chosen, rejected / n_rejected
    odds_term = trainer.odds_ratio_loss(mean_chosen, mean_rejected)[0]
    torch.testing.assert_close(ours, (-mean_chosen - odds_term).mean(), rtol=0, atol=1e-6)


def kto_records(n: int, seed: int = 0) -> list[dict]:
    """The sums of ``preference_records``, each answer alone, labelled: right ones desirable."""
    out = []
    for i, r in enumerate(preference_records(n, seed)):
        good = i % 3 != 0
        out.append({"prompt": r["prompt"], "completion": r["chosen" if good else "rejected"], "label": good})
    return out


def test_kto_equals_trl(tmp_path, hf_llama):
    from trl import KTOConfig, KTOTrainer

    tokenizer, ref, policy = _moved_away(hf_llama)
    records = kto_records(6, seed=5)
    config = {"beta": 0.3, "desirable_weight": 1.2, "undesirable_weight": 0.8}
    theirs = _trl_loss(
        KTOTrainer, KTOConfig, copy.deepcopy(policy), copy.deepcopy(ref), tokenizer, records, tmp_path, **config
    )
    # kiln's rows as its job makes them: the KL rows pair each prompt with the answer before it.
    source = write_jsonl(tmp_path / "kto.jsonl", records)
    val = write_jsonl(tmp_path / "val.jsonl", kto_records(2, seed=6))  # every record of source trains
    cfg = load_config(None, [f"data.source={source}", f"data.val_source={val}", "run.job=kto"])
    data = prepare_preference(cfg.data, tokenizer, 48, kto=True)
    rows = data.train.rows
    assert [r["desirable"] for r in rows] == [r["label"] for r in records]
    reference = Precomputed(tmp_path / "ref", {}, {"train": data.train}, data.collate, len(rows), World())
    (tmp_path / "ref").mkdir()
    reference.logps(CausalLM(ref).eval(), data.collate(rows), "train")
    sets = ["run.job=kto", *(f"preference.{k}={v}" for k, v in config.items())]
    with torch.no_grad():
        ours = PreferenceLoss(load_config(None, sets), reference)(CausalLM(policy).eval(), data.collate(rows))
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-5)


# -- the loop ------------------------------------------------------------------------------------


def test_dpo_starts_at_ln2_with_lora_and_with_the_precomputed_reference(tmp_path, pairs, hf_llama):

    for name, extra in (("lora", {"lora.rank": 4}), ("full", {})):
        run = tmp_path / name
        train(
            load_config(
                None,
                pref_sets(
                    run, pairs, hf_llama, train__max_steps=1, **{k.replace(".", "__"): v for k, v in extra.items()}
                ),
            ),
            console=False,
        )
        first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        if name == "lora":  # the adapters start at exactly zero: ln 2 as float32 computes it, exactly
            assert first["loss"] == torch.tensor(math.log(2)).item()
        else:  # the precomputed pass batches the pairs differently
            assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
        assert (run / "reference_logps.pt").exists() == (name == "full")


@pytest.mark.slow
@pytest.mark.dist
def test_dpo_gradients_are_equal_whatever_the_accumulation_and_world_size(tmp_path, pairs, hf_llama):
    def sets(micro, **kw):
        return pref_sets(tmp_path / f"r{micro}", pairs, hf_llama, train__micro_batch_size=micro, **kw)

    assert_same_gradients_three_ways(sets, tmp_path)


def test_a_tiny_llama_learns_a_learnable_preference(tmp_path, hf_llama):

    source = write_jsonl(tmp_path / "pairs.jsonl", preference_records(160, seed=3))
    run = tmp_path / "run"
    sets = pref_sets(
        run,
        source,
        hf_llama,
        train__max_steps=60,
        train__micro_batch_size=8,
        train__global_batch_size=8,
        train__lr=3e-3,
        train__warmup_steps=5,
        eval__every=60,
        preference__beta=0.5,
    )
    train(load_config(None, sets), console=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_rewards/accuracies" in r][-1]
    assert val["val_rewards/accuracies"] > 0.9, val
    train_losses = [r["loss"] for r in records if "loss" in r]
    assert train_losses[-1] < math.log(2) / 2, train_losses
    assert records[0]["rewards/accuracies"] <= records[-2]["rewards/accuracies"]


def test_the_pair_logps_cover_only_completion_tokens(hf_llama):
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_llama)
    model = CausalLM(transformers.AutoModelForCausalLM.from_pretrained(hf_llama)).eval()
    rec = {"prompt": "1 + 2 =", "chosen": " 3", "rejected": " 4"}
    row = preference_row(Record(rec, Path("p.jsonl"), 1), tokenizer, 48)[0] | {"index": 0}
    long_prompt = preference_row(
        Record(rec | {"rejected": " 4 and more words here"}, Path("p.jsonl"), 1), tokenizer, 48
    )[0] | {"index": 1}
    collate = PairCollate(tokenizer)
    with torch.no_grad():
        alone = pair_logps(model, collate([row]))
        padded = pair_logps(model, collate([row, long_prompt]))
    # Padding the pair to a longer neighbour changes nothing of its log-probabilities.
    for a, b in zip(alone, padded, strict=True):
        torch.testing.assert_close(a[0].float(), b[0].float(), rtol=0, atol=1e-5)
    assert alone[2].item() == len(row["chosen_ids"])


# -- as a user runs it ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"lora__rank": 4}], ids=["precomputed", "lora"])
def test_sigkill_and_resume_is_bitwise(tmp_path, pairs, hf_llama, extra):
    # The resumed run reads the reference back from the run directory: recomputing it with the
    # moved-on model would change every loss after the kill.
    items = pref_sets(tmp_path, pairs, hf_llama, train__max_steps=16, checkpoint__every=3, **extra)
    kill_and_resume(tmp_path, items, kill_after=7)


def test_a_dpo_run_logs_trl_metric_names_and_kiln_eval_scores_it(tmp_path, pairs, hf_llama, capsys):
    run = tmp_path / "run"
    items = pref_sets(run, pairs, hf_llama, train__max_steps=4, eval__every=4, checkpoint__every=4, lora__rank=4)
    assert main(["train", *sets(items)]) == 0
    logged = records(run)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert all(name in r for r in logged if "loss" in r), name
    val = next(r for r in logged if "val_loss" in r)
    assert {"val_rewards/accuracies", "val_rewards/margins", "val_logps/rejected"} <= val.keys()
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["val_loss"] == pytest.approx(val["val_loss"], abs=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert "rewards/margins" in events.Tags()["scalars"]


def test_pairs_cut_to_the_sequence_length_are_counted_and_said(tmp_path, pairs, hf_llama, capsys):
    """As SFT rows: a pair whose prompt and answer pass data.seq_len keeps its start, and the
    console says how many of each split were cut (a run whose every pair is cut says so)."""
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", *sets(pref_sets(run, pairs, hf_llama, data__seq_len=20, train__max_steps=1))]) == 0
    cut = json.loads((run / "data.json").read_text())["truncated"]
    assert cut["train"] > 0
    assert f"{cut['train']:,} train / {cut['val']:,} val truncated to data.seq_len=20" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"parallel.pp": 2, "train.micro_batch_size": 1},
            "parallel.pp_microbatches: each micro-batch of train.micro_batch_size=1",
        ),
        ({"preference.beta": 0}, "preference.beta: must be > 0"),
        ({"preference.precompute_reference": "false"}, "preference.precompute_reference: dpo without LoRA"),
        ({"data.packing": "true"}, "data.packing: preference pairs are padded"),
    ],
)
def test_bad_preference_settings_exit_2_and_write_nothing(tmp_path, pairs, hf_llama, capsys, extra, message):
    run = tmp_path / "run"
    items = pref_sets(run, pairs, hf_llama) + [f"{k}={v}" for k, v in extra.items()]
    assert main(["train", *sets(items)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not run.exists()


def test_a_preference_objective_on_text_is_refused(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "--set", f"run.dir={run}", "--set", f"data.source={corpus_dir}", "--set", "run.job=dpo"]) == 2
    assert "run.job: dpo trains on records" in capsys.readouterr().err
    assert not run.exists()


def test_bad_pair_records_exit_2_naming_file_line_and_field(tmp_path, hf_llama, capsys):
    source = write_jsonl(tmp_path / "bad.jsonl", [*preference_records(5), {"prompt": "1 + 1 =", "chosen": " 2"}])
    run = tmp_path / "run"
    assert main(["train", *sets(pref_sets(run, source, hf_llama))]) == 2
    err = capsys.readouterr().err
    assert f"{source}:6" in err and "rejected" in err, err
    assert not run.exists()


def test_kiln_report_shows_the_rewards(tmp_path, pairs, hf_llama, capsys):
    run = tmp_path / "run"
    items = pref_sets(run, pairs, hf_llama, train__max_steps=2, eval__every=2, lora__rank=4)
    assert main(["train", *sets(items)]) == 0
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rewards      accuracy last" in out and "val " in out.split("rewards")[1], out


@pytest.mark.parametrize("extra", [{"lora__rank": 4}, {}], ids=["lora", "precomputed"])
def test_a_kto_run_learns_and_logs_kl_and_rewards(tmp_path, hf_llama, extra):
    source = write_jsonl(tmp_path / "kto.jsonl", kto_records(120, seed=7))
    run = tmp_path / "run"
    items = pref_sets(
        run,
        source,
        hf_llama,
        run__job="kto",
        train__max_steps=30,
        train__micro_batch_size=8,
        train__global_batch_size=8,
        train__lr=3e-3,
        eval__every=30,
        preference__beta=0.5,
        **extra,
    )
    train(load_config(None, items), console=False)
    logged = records(run)
    trained = [r for r in logged if "loss" in r]
    assert all({"kl", "rewards/chosen", "rewards/rejected", "logps/chosen"} <= r.keys() for r in trained)
    assert trained[0]["loss"] == pytest.approx(0.5, abs=1e-3)  # 1 - sigmoid(0) at the start
    val = next(r for r in logged if "val_loss" in r)
    assert val["val_rewards/margins"] > 0 and val["val_loss"] < 0.5, val


def test_a_kto_label_that_is_not_true_or_false_is_refused(tmp_path, hf_llama, capsys):
    source = write_jsonl(
        tmp_path / "kto.jsonl", [*kto_records(4), {"prompt": "1 + 1 =", "completion": " 2", "label": "yes"}]
    )
    run = tmp_path / "run"
    assert main(["train", *sets(pref_sets(run, source, hf_llama, run__job="kto"))]) == 2
    err = capsys.readouterr().err
    assert f"{source}:5: field 'label' must be true or false, got 'yes'" in err, err
    assert not run.exists()


def test_a_lora_dpo_run_exports_to_transformers_and_peft(tmp_path, pairs, hf_llama):
    peft = pytest.importorskip("peft")
    run = tmp_path / "run"
    items = pref_sets(run, pairs, hf_llama, train__max_steps=4, train__lr=1e-2, checkpoint__every=4, lora__rank=4)
    train(load_config(None, items), console=False)
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    from kiln.train.run import load_run

    ours = load_run(run, device="cpu").model.eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want = ours(ids)
        merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(adapted(ids).logits, want, rtol=0, atol=1e-5)
        assert (transformers.AutoModelForCausalLM.from_pretrained(hf_llama)(ids).logits - want).abs().max() > 1e-4


@pytest.fixture(scope="module")
def dpo_one(tmp_path_factory, pairs, hf_llama) -> Path:
    """One process's DPO run, which every layout's is compared with (trained once)."""
    single = tmp_path_factory.mktemp("dpo-one") / "run"
    train(load_config(None, pref_sets(single, pairs, hf_llama, train__micro_batch_size=1)), console=False)
    return single


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "layout",
    [
        {"parallel__strategy": "ddp"},
        {"parallel__strategy": "fsdp"},
        {"parallel__cp": 2},
        {"parallel__pp": 2, "train__micro_batch_size": 2},
        {"parallel__strategy": "fsdp", "parallel__dp_replicate": 2},
        {"parallel__tp": 2, "train__micro_batch_size": 2},
    ],
    ids=["ddp", "fsdp", "cp", "pp", "hsdp", "tp"],
)
def test_dpo_on_two_ranks_equals_one_process(tmp_path, pairs, hf_llama, dpo_one, layout):
    """Replicas, shards, each pair's sequences split over two ranks (their per-token
    log-probabilities gathered whole on each), or the layers in two pipeline stages (a pair's
    two rows in one piece, the last stage scoring them); or HSDP's two replicas of two shards
    (4 ranks); or two tensor-parallel ranks (each row's log-probabilities from the ranks' rows of
    the vocabulary, its positions padded to whole shares). Every rank computes the reference
    over all pairs in one order, in the run's own layout."""
    run = tmp_path / "run"
    items = pref_sets(run, pairs, hf_llama, **{"train__micro_batch_size": 1, **layout})
    launch(4 if "parallel__dp_replicate" in layout else 2, "train", *sets(items))
    got, want = losses(run), losses(dpo_one)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    for r in (r for r in records(run) if "loss" in r):
        assert {"rewards/accuracies", "rewards/margins"} <= r.keys()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "extra",
    [{"lora__rank": 4, "lora__dropout": 0}, {"run__job": "simpo"}, {"run__job": "kto"}],
    ids=["lora-dpo", "simpo", "kto"],
)
def test_the_preference_family_in_two_pipeline_stages_equals_one_process(tmp_path, pairs, hf_llama, extra):
    """The reference of LoRA's DPO (its adapters off) and KTO's KL baseline (mismatched answers
    under the policy) come from forward passes through the stages before the step's; SimPO needs
    neither."""
    source = pairs
    if extra.get("run__job") == "kto":
        source = write_jsonl(tmp_path / "kto.jsonl", kto_records(64))
    single, run = tmp_path / "single", tmp_path / "run"
    train(load_config(None, pref_sets(single, source, hf_llama, train__micro_batch_size=2, **extra)), console=False)
    launch(2, "train", *sets(pref_sets(run, source, hf_llama, train__micro_batch_size=2, parallel__pp=2, **extra)))
    got, want = losses(run), losses(single)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    logged = [r for r in records(run) if "loss" in r]
    theirs = [r for r in records(single) if "loss" in r]
    for key in ("rewards/chosen", "rewards/margins"):
        assert [r[key] for r in logged] == pytest.approx([r[key] for r in theirs], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_dpo_compiled_trains_as_eager(tmp_path, pairs, hf_llama):
    """Compiled, the model's layers are: the loss (the policy's and the reference's passes, the
    metrics) stays eager around them. The evaluation at the end (the layers in eval mode, the
    adapters on and off) computes as the eager one too."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    extra = {"lora__rank": 4, "lora__dropout": 0, "train__max_steps": 3}
    train(load_config(None, pref_sets(eager, pairs, hf_llama, **extra)), console=False)
    train(load_config(None, pref_sets(compiled, pairs, hf_llama, train__compile="true", **extra)), console=False)
    got, want = losses(compiled), losses(eager)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    [got_val], [want_val] = ([r for r in records(run) if "val_loss" in r] for run in (compiled, eager))
    assert got_val.keys() == want_val.keys() and len(want_val) > 3
    for key, value in want_val.items():
        assert got_val[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_kiln_doctor_checks_a_dpo_config_and_writes_nothing(tmp_path, pairs, hf_llama, capsys):
    run = tmp_path / "run"
    main(["doctor", *sets(pref_sets(run, pairs, hf_llama))])
    out = capsys.readouterr().out
    words = " ".join(out.split())  # the report wraps its lines at a width: "dpo" and "records" may part
    assert "initial loss 0.693" in words and "dpo records" in words, out
    assert not run.exists()
