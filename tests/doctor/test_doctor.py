"""kiln doctor finds planted faults, names their cause, and passes a clean setup."""

import json
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.cli import main as kiln
from kiln.config import load_config
from kiln.data import TokenSequences, prepare, split_of
from kiln.data.shards import VERIFIED
from kiln.doctor import data as doctor_data
from kiln.doctor import doctor_command, run_doctor
from kiln.doctor.report import STATUSES

from conftest import tiny_gpt, tiny_overrides, token_sequences

pytestmark = pytest.mark.e2e

CHECK_FIELDS = {"name", "group", "status", "evidence", "fix", "seconds"}


def builtin_cfg(tmp_path, corpus, **extra):
    """The built-in job on the tiny corpus; extra overrides as in tiny_overrides."""
    return load_config(None, tiny_overrides(tmp_path / "run", corpus, **extra))


def own_cfg(tmp_path, *sets):
    """A config for run_doctor with a user's model and data (the data keys are unused then)."""
    return load_config(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.device=cpu",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "train.lr=1e-2",
            "train.warmup_steps=2",
            "data.num_workers=0",
            *sets,
        ],
    )


def statuses(report):
    return {c.name: c.status for c in report.checks}


def test_clean_setup_passes(tmp_path, corpus_dir):
    report = run_doctor(builtin_cfg(tmp_path, corpus_dir))
    assert report.exit_status == 0, report.render()
    assert {c.group for c in report.checks} == {"environment", "data", "model", "pipeline", "determinism"}
    assert all(c.status in STATUSES for c in report.checks)
    for name in (
        "checksums",
        "token ids",
        "train/val overlap",
        "gradient flow",
        "single-batch overfit",
        "input pipeline",
        "determinism",
    ):
        assert report.get(name).status == "pass", report.render()
    assert "ln(vocabulary 512)" in report.get("initial loss").evidence
    text = report.render()
    assert "single-batch overfit" in text and " 0 fail," in text.splitlines()[-1]


def test_doctor_command_clean_prints_one_json_object(tmp_path, corpus_dir, capsys):
    status = doctor_command(None, tiny_overrides(tmp_path / "run", corpus_dir), as_json=True)
    report = json.loads(capsys.readouterr().out)
    assert status == 0 == report["exit_status"]
    assert report["status"] in ("pass", "warn") and report["counts"]["fail"] == 0
    assert len(report["checks"]) == sum(report["counts"].values()) == 20
    for check in report["checks"]:
        assert set(check) == CHECK_FIELDS and check["status"] in STATUSES and check["evidence"]


@pytest.fixture
def private_cache(tmp_path, corpus_dir):
    """The tiny corpus prepared into a cache of this test's own, safe to damage."""
    cache = tmp_path / "cache"
    prepared = prepare(
        load_config(None, tiny_overrides(tmp_path, corpus_dir, data__cache_dir=cache)).data, progress=False
    )
    return cache, prepared


def test_corrupted_shard_fails_naming_the_file(tmp_path, corpus_dir, private_cache, capsys):
    cache, prepared = private_cache
    # A cache verified once: its reuses check sizes only, and the doctor's checksums find what changed.
    (prepared.dir / VERIFIED).touch()
    shard = prepared.dir / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[1000:1004] = bytes(b ^ 0x01 for b in data[1000:1004])  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))

    sets = [a for i in tiny_overrides(tmp_path / "run", corpus_dir, data__cache_dir=cache) for a in ("--set", i)]
    status = kiln(["doctor", *sets, "--json"])  # through the command line
    report = json.loads(capsys.readouterr().out)
    assert status == 1 == report["exit_status"] and report["status"] == "fail"
    checksums = next(c for c in report["checks"] if c["name"] == "checksums")
    assert checksums["status"] == "fail"
    assert str(shard) in checksums["evidence"] and "checksum does not match" in checksums["evidence"]
    assert "prepare" in checksums["fix"]


def test_token_ids_beyond_the_vocabulary(tmp_path):
    path = tmp_path / "tokens.bin"
    np.tile(np.arange(131, dtype=np.uint16), 40).tofile(path)  # ids up to 130; the model has 97
    data = TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), 16)
    report = run_doctor(own_cfg(tmp_path), model=tiny_gpt(), train_data=data, groups=["data", "model"])
    ids = report.get("token ids")
    assert ids.status == "fail" and "train: max id 130" in ids.evidence and ">= 97" in ids.evidence
    # The model is never run on ids it cannot embed.
    model_checks = [c for c in report.checks if c.group == "model"]
    assert all(c.status == "skip" and "outside the vocabulary" in c.evidence for c in model_checks)


def test_copies_under_other_names_are_removed_so_val_does_not_leak(tmp_path, corpus_dir):
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    train_docs = [p for p in sorted(corpus.iterdir()) if split_of(p.name, 0.05) == "train"][:4]
    for i, doc in enumerate(train_docs):
        # Names the split would send to val: without deduplication, these copies would leak.
        name = next(f"copy{i}-{k}.txt" for k in range(10_000) if split_of(f"copy{i}-{k}.txt", 0.05) == "val")
        shutil.copyfile(doc, corpus / name)
    report = run_doctor(builtin_cfg(tmp_path, corpus, data__cache_dir=tmp_path / "cache"), groups=["data"])
    overlap = report.get("train/val overlap")
    assert overlap.status == "pass" and overlap.evidence.startswith("0 of ")
    assert report.get("duplicates").status == "pass"


def test_own_val_set_sharing_items_with_train_fails(tmp_path):
    data = token_sequences(tmp_path)
    shared = TokenSequences(np.asarray(data.tokens[: 16 * 40 + 1]), 16)  # the first 40 training items
    report = run_doctor(own_cfg(tmp_path), model=tiny_gpt(), train_data=data, val_data=shared, groups=["data"])
    overlap = report.get("train/val overlap")
    assert overlap.status == "fail" and overlap.evidence.startswith("40 of 40 val items also appear in train")
    assert "remove from val" in overlap.fix


class WithUnusedParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()
        self.unused = nn.Linear(4, 4)  # registered, never called in forward

    def forward(self, x, y):
        return self.gpt(x, y)


def test_detached_parameter_is_named(tmp_path):
    report = run_doctor(
        own_cfg(tmp_path), model=WithUnusedParameter(), train_data=token_sequences(tmp_path), groups=["model"]
    )
    flow = report.get("gradient flow")
    assert flow.status == "fail" and "unused.weight" in flow.evidence and "unused.bias" in flow.evidence
    assert "gpt." not in flow.evidence
    assert report.exit_status == 1


def test_learning_rate_too_high_does_not_overfit(tmp_path):
    # The same setup at train.lr=1e-2 memorises its batch: test_clean_setup_passes.
    report = run_doctor(
        own_cfg(tmp_path, "train.lr=10"), model=tiny_gpt(), train_data=token_sequences(tmp_path), groups=["model"]
    )
    overfit = report.get("single-batch overfit")
    assert overfit.status == "fail" and "train.lr=10" in overfit.evidence and "diverges" in overfit.evidence
    assert "lower train.lr" in overfit.fix


class SlowDataset(Dataset):
    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return self.inner[i]


def test_slow_loader_warns_with_a_recommended_worker_count(tmp_path, monkeypatch):
    # The data scan behind the model's safety check reads items for up to ITEM_SECONDS; keep it short.
    monkeypatch.setattr(doctor_data, "ITEM_SECONDS", 0.2)
    data = SlowDataset(token_sequences(tmp_path), seconds=0.02)  # 160 ms per batch of 8
    report = run_doctor(own_cfg(tmp_path), model=tiny_gpt(), train_data=data, groups=["pipeline"])
    pipeline = report.get("input pipeline")
    assert pipeline.status == "warn", pipeline.evidence
    recommended = int(pipeline.evidence.split("recommended data.num_workers=")[1].split()[0])
    assert recommended >= 2 and f"set data.num_workers={recommended}" in pipeline.fix
    assert report.exit_status == 0  # a warning does not fail the doctor


class Noisy(nn.Module):
    """A model whose loss depends on randomness that no seed controls."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()

    def forward(self, x, y):
        return self.gpt(x, y) + int.from_bytes(os.urandom(2), "big") / 2**16


def test_unseeded_randomness_fails_determinism(tmp_path):
    report = run_doctor(own_cfg(tmp_path), model=Noisy(), train_data=token_sequences(tmp_path), groups=["determinism"])
    check = report.get("determinism")
    assert check.status == "fail" and "first differ at step 1" in check.evidence


def test_documents_are_cut_at_end_of_text_within_windows():
    stream = np.array([5, 6, 0, 7, 0, 0, 8, 9, 9, 0, 4, 4], dtype=np.uint16)  # 0 is the end-of-text id
    assert doctor_data._document_spans(stream, 0, [(0, len(stream))]) == [(0, 2), (3, 4), (5, 5), (6, 9), (10, 12)]
    # A window starting mid-stream drops the piece before its first EOT (a document's tail).
    assert doctor_data._document_spans(stream, 0, [(4, 10)]) == [(5, 5), (6, 9)]


def test_big_streams_are_sampled_and_the_evidence_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor_data, "SCAN_TOKENS", 1600)
    report = run_doctor(own_cfg(tmp_path), model=tiny_gpt(), train_data=token_sequences(tmp_path), groups=["data"])
    assert "1,600 of 20,000 tokens in 16 evenly spaced windows" in report.get("token ids").evidence
    assert report.get("checksums").status == "skip"  # user data has no manifest


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_fails_and_skips_the_model(tmp_path):
    report = run_doctor(
        own_cfg(tmp_path, "run.device=cuda"),
        model=tiny_gpt(),
        train_data=token_sequences(tmp_path),
        groups=["environment", "model"],
    )
    device = report.get("device & CUDA")
    assert device.status == "fail" and "run.device" in device.evidence
    assert {c.status for c in report.checks if c.group == "model"} == {"skip"}


def test_unusable_data_source_is_reported_not_raised(tmp_path, capsys):
    status = doctor_command(None, [f"run.dir={tmp_path / 'run'}", f"data.source={tmp_path / 'missing'}"], as_json=False)
    out = capsys.readouterr().out
    assert status == 1
    source_line = next(line for line in out.splitlines() if "data source" in line)
    # The report wraps long lines where the terminal's width (or the path's length) says.
    assert "fail" in source_line and "no such file or directory" in " ".join(out.split())
    assert "skip  gradient flow" in out  # nothing to run the model on


def test_cuda_setup_problems_are_explained(tmp_path, monkeypatch):
    """The GPU branches, on any machine: a GPU this PyTorch has no kernels for, an old driver."""
    from kiln.doctor import environment as doctor_env

    gpu = SimpleNamespace(name="NVIDIA H100", major=9, minor=0, total_memory=80 * 2**30)
    job = SimpleNamespace(device_problem=None, device=torch.device("cuda"))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(doctor_env, "_driver_cuda_version", lambda: (11, 8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, evidence, fix = doctor_env.check_device(job)
    assert status == "warn" and "driver supports CUDA up to 11.8" in evidence and "update the NVIDIA driver" in fix

    monkeypatch.setattr(doctor_env, "_driver_cuda_version", lambda: (12, 6))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpu)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_86"])
    status, evidence, _ = doctor_env.check_device(job)
    assert status == "fail" and "no kernels for cuda:0 (sm_90)" in evidence
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90"])
    assert doctor_env.check_device(job)[0] == "pass"


def test_fine_tuning_records_are_checked(tmp_path, hf_bert):
    """A classifier's records with planted faults: exact copies, records that also sit in the
    validation file (left out of training), one label far rarer than the others, and records cut
    to data.seq_len."""
    from conftest import write_jsonl

    common = [{"text": f"a fine day number {i} " + "word " * (i % 3), "label": "common"} for i in range(60)]
    rare = [{"text": f"a rare event {i}", "label": "rare"} for i in range(3)]
    long = [{"text": f"case {i} " + "very long " * 40, "label": "common"} for i in range(8)]
    train = write_jsonl(tmp_path / "train.jsonl", common + common[:6] + rare + long)
    val = write_jsonl(tmp_path / "val.jsonl", common[:4] + [{"text": "another rare one", "label": "rare"}])
    cfg = load_config(
        None,
        [
            f"model.source=hf:{hf_bert}",
            "model.task=sequence_classification",
            f"data.source={train}",
            f"data.val_source={val}",
            "data.seq_len=32",
            "data.num_workers=0",
            f"run.dir={tmp_path / 'run'}",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
        ],
    )
    report = run_doctor(cfg, groups=["data", "model"])
    records = report.get("fine-tuning records")
    assert records.status == "warn"
    # The 4 records also in the validation file (8 with their copies) are left out of training.
    assert "8 of 74 records (10.8%) truncated" in records.evidence and "common: 66, rare: 3" in records.evidence
    assert "unbalanced (66 against 3 records)" in records.evidence
    assert report.get("duplicates").status == "warn" and "2 of 69 items repeat" in report.get("duplicates").evidence
    assert report.get("train/val overlap").status == "pass"
    assert "0 of 5 val items also appear in train" in report.get("train/val overlap").evidence
    initial = report.get("initial loss")
    assert initial.status == "pass" and "ln(2 classes)" in initial.evidence
    assert report.get("gradient flow").status == "pass"
    assert not (tmp_path / "run").exists()
