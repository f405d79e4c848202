"""Fine-tuning Hugging Face models through the loop: token-exact gradients whatever the
accumulation and world size, packing without cross-contamination, classification, LoRA, the
exported directory in transformers and peft, exact resume after SIGKILL, DDP and FSDP, and
bad input refused before anything is written."""

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from kiln.cli import main
from kiln.config import DataConfig, load_config
from kiln.data.finetune import pack, prepare_finetune
from kiln.data.shards import VERIFIED
from kiln.labels import IGNORE_INDEX
from kiln.models.hf import FAMILY
from kiln.train.evaluate import classification_metrics
from kiln.train.jobs import job_for
from kiln.train.run import load_run
from kiln.train.trainer import Trainer, train

from conftest import ft_sets, sft_records, write_jsonl
from grad_probe import assert_same_gradients_three_ways, step_gradients
from hf_models import learnable_classes, verse_and_prose
from kilnrun import in_process, kill_and_resume, launch, losses

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")
TESTS = Path(__file__).parents[1]


def as_args(sets: list[str]) -> list[str]:
    return [a for item in sets for a in ("--set", item)]


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("sft") / "sft.jsonl", sft_records(96))


# -- token-exact normalisation -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.dist
def test_gradients_are_equal_whatever_the_accumulation_and_world_size(tmp_path, sft, hf_llama):
    def sets(micro, **kw):
        return ft_sets(tmp_path / f"r{micro}", sft, hf_llama, train__micro_batch_size=micro, **kw)

    assert_same_gradients_three_ways(sets, tmp_path)
    # The batch really is padded with rows of different lengths and loss tokens.
    data = prepare_finetune(
        DataConfig(source=str(sft), seq_len=64), "causal_lm", transformers.AutoTokenizer.from_pretrained(hf_llama), 64
    )
    counts = {sum(t != IGNORE_INDEX for t in r["labels"][1:]) for r in data.train.rows[:20]}
    assert len(counts) > 2


# -- packing -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(hf_llama):
    args = FAMILY.resolve(load_config(None, [f"model.source=hf:{hf_llama}"]).model, vocab_size=0, seq_len=64)
    return FAMILY.create(args, "cpu", seed=0).eval(), transformers.AutoTokenizer.from_pretrained(hf_llama)


def test_packed_and_unpacked_token_losses_sum_to_the_same(llama, sft):
    model, tok = llama
    data = prepare_finetune(DataConfig(source=str(sft), seq_len=64), "causal_lm", tok, 64)
    rows = data.train.rows[:24]
    with torch.no_grad():
        unpacked = sum(FAMILY.loss(model, data.collate([r])).double() * data.collate([r]).count for r in rows)
        packs = pack(rows, 64)
        assert len(packs) < len(rows)
        packed = sum(FAMILY.loss(model, b).double() * b.count for b in (data.collate([p]) for p in packs))
    assert packed.item() == pytest.approx(unpacked.item(), rel=1e-5)


def test_changing_one_record_leaves_the_others_in_its_pack_bit_identical(llama, sft):
    model, tok = llama
    data = prepare_finetune(DataConfig(source=str(sft), seq_len=64), "causal_lm", tok, 64)
    rows = [r for r in data.train.rows if len(r["input_ids"]) <= 20][:3]
    first = pack(rows, 64)
    assert len(first) == 1 and first[0]["records"] == 3
    changed = [dict(rows[0], input_ids=[(t + 7) % len(tok) for t in rows[0]["input_ids"]]), *rows[1:]]
    second = pack(changed, 64)
    starts = [i for i, p in enumerate(first[0]["position_ids"]) if p == 0]
    ids_a, ids_b = first[0]["input_ids"], second[0]["input_ids"]
    diff = [i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=True)) if a != b]
    which = max(s for s in starts if s <= diff[0])  # where the changed record starts
    batch_a, batch_b = data.collate(first), data.collate(second)
    with torch.no_grad():
        a = model(batch_a.input_ids, position_ids=batch_a.position_ids)
        b = model(batch_b.input_ids, position_ids=batch_b.position_ids)
    end = dict(zip(starts, [*starts[1:], len(ids_a)], strict=True))
    for s in starts:
        if s != which:
            assert torch.equal(a[0, s : end[s]], b[0, s : end[s]]), f"record at {s} changed"
    assert not torch.equal(a[0, which : end[which]], b[0, which : end[which]])


# -- classification ----------------------------------------------------------------------------


def test_metrics_equal_scikit_learn():
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score, recall_score

    rng = random.Random(3)
    labels = ["a", "b", "c", "d"]
    y_true = [rng.randrange(3) for _ in range(200)]  # "d" never occurs as a true label
    y_pred = [t if rng.random() < 0.6 else rng.randrange(4) for t in y_true]
    confusion = [[0] * 4 for _ in range(4)]
    for t, p in zip(y_true, y_pred, strict=True):
        confusion[t][p] += 1
    got = classification_metrics(confusion, labels)
    assert confusion == confusion_matrix(y_true, y_pred, labels=range(4)).tolist()
    assert got["val_accuracy"] == pytest.approx(accuracy_score(y_true, y_pred))
    assert got["val_macro_f1"] == pytest.approx(f1_score(y_true, y_pred, average="macro", zero_division=0))
    precision = precision_score(y_true, y_pred, labels=range(4), average=None, zero_division=0)
    recall = recall_score(y_true, y_pred, labels=range(4), average=None, zero_division=0)
    for i, name in enumerate(labels):
        assert got[f"val_precision/{name}"] == pytest.approx(precision[i])
        assert got[f"val_recall/{name}"] == pytest.approx(recall[i])


def test_a_tiny_classifier_learns_a_learnable_set(tmp_path, hf_bert, capsys):
    source = write_jsonl(tmp_path / "cls.jsonl", learnable_classes())
    run = tmp_path / "run"
    sets = ft_sets(
        run,
        source,
        hf_bert,
        model__task="sequence_classification",
        train__max_steps=100,
        train__micro_batch_size=16,
        train__global_batch_size=16,
        train__lr=3e-3,
        train__log_every=10,
        eval__every=100,
        data__val_fraction=0.2,
        checkpoint__every=0,
    )
    result = Trainer(job_for(load_config(None, sets)), console=False).fit()
    assert result.eval_metrics["val_accuracy"] >= 0.9, result.eval_metrics
    record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert len(record["val_confusion"]) == 3 and {"val_macro_f1", "val_recall/food"} <= set(record)
    # kiln eval scores the run's validation records again; kiln report summarises the classifier.
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["val_accuracy"] == record["val_accuracy"] and again["val_confusion"] == record["val_confusion"]
    assert main(["report", str(run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["val_accuracy_best"] == record["val_accuracy"] >= 0.9
    # Exported, transformers' own classes predict the same classes with the label names.
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.config.id2label == {0: "code", 1: "food", 2: "sport"}
    texts = [r["text"] for r in learnable_classes(8, seed=9)]
    enc = tok(texts, padding=True, return_tensors="pt")
    kiln_model = load_run(run, device="cpu").model
    with torch.no_grad():
        torch.testing.assert_close(
            hf(**enc).logits,
            kiln_model(enc["input_ids"], attention_mask=enc["attention_mask"], token_type_ids=enc["token_type_ids"]),
            rtol=0,
            atol=1e-5,
        )


@pytest.mark.slow
def test_the_real_pretrained_minilm_tells_verse_from_prose_in_20_steps(tmp_path, minilm_dir):
    """all-MiniLM-L6-v2 (a base model's save, no bert. prefix) fine-tuned as a two-class
    classifier at lr 5e-5: pretrained, it is right on nine records in ten after 20 steps (1.0
    measured); from the random values a misread checkpoint would give it, on 0.59 (measured with
    model.weights=random; at 40 steps 0.74)."""
    records = verse_and_prose(240)
    train_file = write_jsonl(tmp_path / "train.jsonl", records[:400])
    val_file = write_jsonl(tmp_path / "val.jsonl", records[400:])
    run = tmp_path / "run"
    sets = ft_sets(
        run,
        train_file,
        minilm_dir,
        model__task="sequence_classification",
        data__val_source=val_file,
        data__seq_len=48,
        train__max_steps=20,
        train__micro_batch_size=16,
        train__global_batch_size=16,
        train__lr=5e-5,
        train__warmup_steps=4,
        train__log_every=10,
        eval__every=20,
        checkpoint__every=0,
    )
    proc = in_process("train", *as_args(sets))
    head = "initialise 2 (classifier head: classifier.bias, classifier.weight)"
    assert f"kiln: weights: load 103 tensors from 1 file, {head}" in proc.stdout
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["val_accuracy"] >= 0.9, final


# -- LoRA --------------------------------------------------------------------------------------


def test_lora_trains_only_adapters_and_its_adapter_loads_in_peft(tmp_path, sft, hf_llama):
    peft = pytest.importorskip("peft")
    run = tmp_path / "lora"
    sets = ft_sets(run, sft, hf_llama, lora__rank=4, lora__alpha=8, lora__dropout=0.0, train__lr=1e-2)
    trainer = Trainer(job_for(load_config(None, sets)), console=False)
    trainable = {n for n, p in trainer.model.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    trainer.fit()
    got = {n for n, p in trainer.model.module.named_parameters() if p.requires_grad}
    assert got == trainable  # nothing else was unfrozen
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "adapter" / "adapter_config.json").is_file() and (
        out / "adapter" / "adapter_model.safetensors"
    ).is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    kiln_model = load_run(run, device="cpu").model
    ids = torch.randint(0, merged.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()  # adds the adapters to base
        ours = kiln_model(ids)
        torch.testing.assert_close(adapted(ids).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=1e-5)
        assert (before - ours).abs().max() > 1e-3  # the adapters did change the model


# -- resume, data parallelism ------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise_for_causal_lm(tmp_path, sft, hf_llama):
    kill_and_resume(
        tmp_path,
        ft_sets(tmp_path, sft, hf_llama, train__max_steps=24, checkpoint__every=3, data__packing="true"),
        kill_after=7,
    )


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise_for_classification(tmp_path, hf_bert):
    source = write_jsonl(tmp_path / "cls.jsonl", learnable_classes(120))
    kill_and_resume(
        tmp_path,
        ft_sets(
            tmp_path,
            source,
            hf_bert,
            model__task="sequence_classification",
            train__max_steps=30,
            checkpoint__every=3,
            train__micro_batch_size=4,
            train__global_batch_size=8,
        ),
        kill_after=7,
    )


@pytest.fixture(scope="module")
def single(tmp_path_factory, sft, hf_llama) -> Path:
    run = tmp_path_factory.mktemp("single") / "run"
    in_process("train", *as_args(ft_sets(run, sft, hf_llama, train__micro_batch_size=2)))
    return run


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process(tmp_path, sft, hf_llama, single, strategy):
    run = tmp_path / strategy
    launch(
        2,
        "train",
        *as_args(ft_sets(run, sft, hf_llama, train__micro_batch_size=1, parallel__strategy=strategy)),
    )
    assert_trains_as(run, single)


@pytest.mark.slow
@pytest.mark.dist
def test_hsdp_trains_packed_records_as_one_process(tmp_path, sft, hf_llama, single_packed):
    """Two replicas of two FSDP ranks (4 ranks), on packed records."""
    run = tmp_path / "hsdp"
    layout = dict(parallel__strategy="fsdp", parallel__dp_replicate=2, data__packing="true")
    launch(4, "train", *as_args(ft_sets(run, sft, hf_llama, train__micro_batch_size=1, **layout)))
    assert_trains_as(run, single_packed)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "records, extra, message",
    [
        (
            [{"prompt": "Add 1. ", "completion": ""}] * 3,
            {},
            "bad.jsonl:1: field 'completion' (data.completion_field) is empty",
        ),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}] * 3,
            {},
            "bad.jsonl:1: field 'messages' has no assistant turn",
        ),
        (
            [{"question": "?", "answer": "!"}] * 3,
            {},
            "bad.jsonl:1: no field 'prompt' (data.prompt_field); its fields are question, answer",
        ),
        ([], {}, "bad.jsonl: no records (the file is empty)"),
        (
            [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}],
            {"model.task": "sequence_classification", "data.label_field": "class"},
            "no field 'class' (data.label_field)",
        ),
    ],
)
def test_bad_records_exit_2_naming_file_line_and_field_and_write_nothing(
    tmp_path, hf_llama, hf_bert, capsys, records, extra, message
):
    source = write_jsonl(tmp_path / "bad.jsonl", records)
    model = hf_bert if extra.get("model.task") == "sequence_classification" else hf_llama
    run = tmp_path / "run"
    sets = ft_sets(run, source, model) + [f"{k}={v}" for k, v in extra.items()]
    assert main(["train", *as_args(sets)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not run.exists()


def test_a_model_needing_remote_code_is_refused_before_anything_runs(tmp_path, hf_llama, sft, capsys):
    config = json.loads((hf_llama / "config.json").read_text())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    assert main(["train", *as_args(ft_sets(tmp_path / "run", sft, model))]) == 2
    assert "kiln never runs code from a model directory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_activation_checkpointing_per_layer_gives_the_same_gradients(tmp_path, sft, hf_llama):
    plain = step_gradients(ft_sets(tmp_path / "plain", sft, hf_llama))
    checkpointed = step_gradients(ft_sets(tmp_path / "ac", sft, hf_llama, train__activation_checkpointing="true"))
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6, msg=name)


def test_bf16_fine_tuning_runs(tmp_path, sft, hf_llama):
    result = train(load_config(None, ft_sets(tmp_path, sft, hf_llama, train__precision="bf16")), console=False)
    assert result.step == 8 and 0 < result.metrics["loss"] < 10


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "layout",
    [{}, {"lora__rank": 4, "lora__alpha": 8, "lora__dropout": 0.0}, {"parallel__pp": 2}, {"parallel__cp": 2}],
    ids=["tp", "tp-lora", "tp-pp", "tp-cp"],
)
def test_llama_class_models_split_over_two_tensor_parallel_ranks(tmp_path, sft, hf_llama, single, layout):
    """Sequence, vocabulary and loss parallelism on padded rows of any length (padded again to
    whole shares of positions); with LoRA adapters (a row-split layer's B added to its output
    split by position), in two pipeline stages (each sending its positions on) and beside two
    context-parallel ranks (4 ranks each)."""
    run = tmp_path / "tp"
    nproc = 4 if {"parallel__pp", "parallel__cp"} & layout.keys() else 2
    strategy = {"parallel__strategy": "fsdp"} if "parallel__cp" in layout else {}
    launch(
        nproc,
        "train",
        *as_args(ft_sets(run, sft, hf_llama, train__micro_batch_size=2, parallel__tp=2, **layout, **strategy)),
    )
    if "lora__rank" in layout:  # against one process's LoRA run
        single = tmp_path / "one"
        in_process("train", *as_args(ft_sets(single, sft, hf_llama, train__micro_batch_size=2, **layout)))
    assert_trains_as(run, single)


def assert_trains_as(run: Path, reference: Path) -> None:
    """``run``'s losses those of ``reference`` (rel 1e-5), its weights too (1e-4)."""
    got, want = losses(run), losses(reference)
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    a, b = load_run(run, device="cpu").model.state_dict(), load_run(reference, device="cpu").model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)


@pytest.fixture(scope="module")
def single_packed(tmp_path_factory, sft, hf_llama) -> Path:
    run = tmp_path_factory.mktemp("single_packed") / "run"
    in_process("train", *as_args(ft_sets(run, sft, hf_llama, data__packing="true")))
    return run


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_llama_class_models_split_their_sequences_over_two_context_parallel_ranks(
    tmp_path, sft, hf_llama, single, single_packed, packing
):
    """Each record's tokens split over two ranks (padded rows cut to whole chunks; packed rows
    keeping each record's attention to itself across the chunks): one process's training."""
    run = tmp_path / "cp"
    items = ft_sets(run, sft, hf_llama, parallel__cp=2, data__packing=str(packing).lower())
    launch(2, "train", *as_args(items))
    assert_trains_as(run, single_packed if packing else single)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("packing", "cp"), [(False, 1), (True, 1), (True, 2)], ids=["padded", "packed", "packed-cp2"])
def test_llama_class_models_split_into_two_pipeline_stages(tmp_path, sft, hf_llama, single, single_packed, packing, cp):
    """A Llama's layers in two stages, padded rows (their attention mask passed to each stage) or
    packed ones (their restarting positions), and each stage's sequences split over two
    context-parallel ranks: one process's training, evaluation included."""
    run = tmp_path / "pp"
    items = ft_sets(
        run, sft, hf_llama, parallel__pp=2, parallel__cp=cp, data__packing=str(packing).lower(), eval__every=4
    )
    launch(2 * cp, "train", *as_args(items))
    assert_trains_as(run, single_packed if packing else single)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "phi3"])
def test_other_llama_class_models_split_over_two_tensor_parallel_ranks(tmp_path, sft, model_type):
    """Llama's plan with per-head query and key norms (their gains replicated, their gradients
    summed over the ranks' heads): Qwen3's, and Gemma 3's after it moves the heads first (with
    its four norms per layer and its sliding-window layers); and Phi-3's fused projections, each
    rank's slice of their outputs gathered whole."""
    from hf_models import save_tiny

    model = save_tiny(tmp_path / model_type, model_type, tokenizer=True)
    one, tp = tmp_path / "one", tmp_path / "tp"
    in_process("train", *as_args(ft_sets(one, sft, model, train__max_steps=4)))
    launch(2, "train", *as_args(ft_sets(tp, sft, model, train__max_steps=4, parallel__tp=2)))
    assert_trains_as(tp, one)


def test_a_causal_lm_continues_pretraining_on_text_with_its_own_tokenizer(tmp_path, corpus_dir, hf_llama, capsys):
    run, cache = tmp_path / "text", tmp_path / "cache"
    sets = ft_sets(run, corpus_dir, hf_llama, train__max_steps=12, eval__every=12, eval__sample_tokens=8)
    sets += [f"data.cache_dir={cache}"]
    # `kiln prepare` caches what `kiln train` then reads: the text as the model's tokenizer makes it.
    assert main(["prepare", *as_args(sets)]) == 0
    assert "kiln: tokenized" in capsys.readouterr().out
    prepared = sorted(cache.rglob("*"))
    assert main(["train", *as_args(sets)]) == 0
    assert sorted(p for p in cache.rglob("*") if p.name != VERIFIED) == prepared  # and its digests checked
    steps = losses(run)
    assert steps[12] < steps[1]
    # The text was tokenized by the model's own tokenizer, whose end-of-sequence token ends documents.
    own = transformers.AutoTokenizer.from_pretrained(hf_llama)
    manifest = json.loads((run / "data.json").read_text())
    saved, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")).to_str() for d in (run, hf_llama))
    assert saved == theirs
    assert manifest["vocab_size"] == len(own)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_text_with_a_tokenizer_of_ones_own_is_refused_for_a_model_with_its_own(tmp_path, corpus_dir, hf_llama, capsys):
    sets = ft_sets(tmp_path / "run", corpus_dir, hf_llama, data__tokenizer=hf_llama / "tokenizer.json")
    assert main(["train", *as_args(sets)]) == 2
    assert "data.tokenizer" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_compile_matches_eager_for_a_hugging_face_model(tmp_path, corpus_dir, hf_llama):
    runs = {}
    for name, compile_ in (("eager", "false"), ("compiled", "true")):
        runs[name] = tmp_path / name
        sets = ft_sets(runs[name], corpus_dir, hf_llama, train__max_steps=4, train__compile=compile_, eval__every=0)
        assert main(["train", *as_args(sets)]) == 0
    eager, compiled = losses(runs["eager"]), losses(runs["compiled"])
    assert compiled.keys() == eager.keys() and all(compiled[s] == pytest.approx(eager[s], rel=1e-5) for s in eager)
