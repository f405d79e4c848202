"""Training on a weighted mixture of two corpora: the rows of every step come from the sources at
their weights (by the run's own count and by reading the rows), validation reports each source,
a resumed run is bitwise the uninterrupted one, and two DDP ranks train as one process."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.loader import StepBatches
from kiln.data.shards import VERIFIED
from kiln.distributed.world import World
from kiln.train.jobs import job_for

from conftest import tiny_overrides
from kilnrun import in_process, losses, records
from layouts import assert_same_training, resumable_copy, train_on, weights

WORDS = {"a": ["apple", "avocado", "anchor", "amber", "arrow"], "b": ["bison", "banjo", "beryl", "bottle", "brick"]}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    """a.jsonl (field text) and b.jsonl (field content): documents of words of one letter each."""
    out = tmp_path_factory.mktemp("mix")
    rng = random.Random(0)
    for name, field in (("a", "text"), ("b", "content")):
        with open(out / f"{name}.jsonl", "w") as f:
            for _ in range(300):
                f.write(json.dumps({field: " ".join(rng.choice(WORDS[name]) for _ in range(60))}) + "\n")
    return out


def mix_sets(run_dir: Path, corpora: Path, **extra) -> list[str]:
    a, b = corpora / "a.jsonl", corpora / "b.jsonl"
    mix = f'[{{source="{a}", weight=0.8}}, {{source="{b}", weight=0.2, text_field="content"}}]'
    items = tiny_overrides(run_dir, corpora / "a.jsonl", data__source="stdlib", data__mix=mix, **extra)
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, corpora) -> Path:
    run_dir = tmp_path_factory.mktemp("mixrun") / "run"
    sets = mix_sets(run_dir, corpora, train__max_steps=200, eval__every=100, checkpoint__every=0, data__max_epochs=1)
    in_process("train", *sets)
    return run_dir


@pytest.mark.slow
def test_two_hundred_steps_draw_each_source_at_its_weight(long_run):
    last = [r for r in records(long_run) if "data/tokens/a" in r][-1]
    assert last["step"] == 200
    share = last["data/tokens/a"] / (last["data/tokens/a"] + last["data/tokens/b"])
    assert share == pytest.approx(0.8, abs=0.01)
    # Source a (0.8 of the rows) goes round more than once, b does not: a warning for a alone.
    assert last["data/epochs/a"] > 1 > last["data/epochs/b"] > 0
    warned = [r for r in records(long_run) if r.get("event") == "data_repeated"]
    assert [r["source"] for r in warned] == ["a"]
    # An independent count: the rows of every step, read back as text.
    cfg = load_config(long_run / "config.toml")
    job = job_for(cfg)
    job.prepare(World(), console=False)
    schedule = BatchSchedule.from_config(cfg.train, job.tokens_per_sample)
    batches = StepBatches(job.train_data, schedule, cfg.train.seed, num_workers=0, pin_memory=False)
    tokenizer = job.prepared.tokenizer
    origin = {"a": 0, "b": 0}
    for step in range(1, 201):
        x, _ = batches.batch(step, torch.device("cpu"))
        for row in x.tolist():
            text = tokenizer.decode(row)
            kinds = {k for k, words in WORDS.items() if any(w in text for w in words)}
            assert len(kinds) == 1, text
            origin[kinds.pop()] += 1
    assert origin["a"] / 1600 == pytest.approx(0.8, abs=0.01)
    assert origin["a"] * cfg.data.seq_len == last["data/tokens/a"]


@pytest.mark.slow
def test_validation_reports_each_source_and_their_weighted_mean(long_run, tmp_path):
    scores = [r for r in records(long_run) if "val_loss/a" in r][-1]
    assert scores["val_loss"] == pytest.approx(0.8 * scores["val_loss/a"] + 0.2 * scores["val_loss/b"])
    assert scores["val_bpb"] == pytest.approx(0.8 * scores["val_bpb/a"] + 0.2 * scores["val_bpb/b"])
    proc = in_process("eval", long_run)
    saved = json.loads(proc.stdout)
    assert {"val_loss/a", "val_loss/b", "val_loss"} <= saved.keys()
    report = in_process("report", long_run).stdout
    assert "source a" in report and "source b" in report and "epochs  val loss last" in report


def test_a_resumed_mixture_run_is_the_uninterrupted_one_bitwise(tmp_path, corpora):
    whole = tmp_path / "whole"
    in_process("train", *mix_sets(whole, corpora, train__max_steps=12, checkpoint__every=6))
    resumed = resumable_copy(whole, tmp_path / "resumed", 6)
    proc = in_process("train", *mix_sets(resumed, corpora, train__max_steps=12, checkpoint__every=6))
    assert "resumed from" in proc.stdout and losses(resumed) == losses(whole)
    for (name, a), b in zip(weights(resumed).items(), weights(whole).values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.dist
def test_a_mixture_on_two_ddp_ranks_trains_as_one_process(tmp_path, corpora):
    one, two = tmp_path / "one", tmp_path / "two"
    in_process("train", *mix_sets(one, corpora, train__max_steps=6, train__micro_batch_size=2))
    train_on(2, mix_sets(two, corpora, train__max_steps=6, train__micro_batch_size=2))
    assert_same_training(two, one)


@pytest.mark.parametrize(
    ("mix", "extra", "message"),
    [
        ('[{source="x.jsonl", weight=0}]', {}, "data.mix[0].weight: must be a number above 0"),
        ('[{source="x.jsonl", weight="lots"}]', {}, "data.mix[0].weight: expected a number"),
        ("[{weight=1}]", {}, "data.mix[0]: needs source = ..."),
        ('[{source="x.jsonl", weight=1}]', {"data.source": "y.jsonl"}, "data.mix: give either data.source"),
        ('[{source="x.jsonl", weight=1}]', {"data.format": "records"}, "data.mix: a mixture is of text corpora"),
    ],
)
def test_bad_mixtures_are_named_before_anything_runs(tmp_path, mix, extra, message):
    sets = [f"run.dir={tmp_path / 'run'}", f"data.mix={mix}", *(f"{k}={v}" for k, v in extra.items())]
    proc = in_process("train", *(a for s in sets for a in ("--set", s)), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_missing_source_of_a_mixture_is_named(tmp_path, corpora):
    sets = mix_sets(tmp_path / "run", corpora)
    sets = [s.replace(str(corpora / "b.jsonl"), str(corpora / "missing.jsonl")) for s in sets]
    proc = in_process("train", *sets, check=False)
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr, proc.stderr


def test_kiln_prepare_caches_every_source_that_train_then_reads(tmp_path, corpora):
    cache = tmp_path / "cache"
    args = [*mix_sets(tmp_path / "run", corpora, train__max_steps=2), "--set", f"data.cache_dir={cache}"]
    said = in_process("prepare", *args).stdout
    assert "data.mix source 'a'" in said and "data.mix source 'b'" in said and said.count("kiln: tokenized") == 2
    prepared = sorted(cache.rglob("*"))
    in_process("train", *args)
    # Nothing tokenized again: only the marks that the first reuse checked the files' digests.
    assert sorted(p for p in cache.rglob("*") if p.name != VERIFIED) == prepared
