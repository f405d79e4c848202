"""BPE training on a sample of the train split (data.tokenizer_sample_bytes)."""

import json

import pytest

from kiln.config import DataConfig
from kiln.data.corpus import open_corpus
from kiln.data.shards import prepare
from kiln.data.tokenizer import bpe_cache_path, load_or_train_tokenizer, sample_documents, tokenizer_hash

TOPICS = [
    "the river flows past the mill and the miller grinds the grain",
    "compilers parse tokens into syntax trees before emitting machine code",
    "photosynthesis turns sunlight water and carbon dioxide into sugar",
    "the orchestra tuned its violins while the conductor waited",
    "glaciers carve valleys over thousands of years of slow motion",
]


@pytest.fixture
def source(tmp_path):
    """Three files of documents on different topics, so a sample's merges differ from the whole's."""
    root = tmp_path / "corpus"
    root.mkdir()
    n = 0
    for f in range(3):
        lines = []
        for i in range(60):
            topic = TOPICS[(n * 7 + i) % len(TOPICS)]
            lines.append(json.dumps({"text": f"{topic} {n} " * (1 + n % 9)}))
            n += 1
        (root / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return str(root)


def train_bytes(corpus) -> int:
    return sum(len(t.encode()) for _, t in corpus.documents("train"))


def test_sample_is_deterministic_spread_and_bounded(source):
    corpus = open_corpus(source, val_fraction=0.1)
    total = train_bytes(corpus)
    texts, count = sample_documents(corpus, total // 4)
    picked = list(texts)
    assert len(picked) == count and 0 < sum(len(t.encode()) for t in picked) <= total // 4
    again, _ = sample_documents(open_corpus(source, val_fraction=0.1), total // 4)
    assert list(again) == picked
    # Spread over the corpus, not its first quarter: documents from every file.
    names = {name for name, text in corpus.documents("train") if text in set(picked)}
    assert {name.split(":")[0] for name in names} == {"part0", "part1", "part2"}
    # All of it when the limit is 0 or not below the split's size.
    everything = [t for _, t in corpus.documents("train")]
    for limit in (0, total, total * 10):
        texts, count = sample_documents(corpus, limit)
        assert list(texts) == everything and count == corpus.count("train")


def test_sampled_bpe_differs_from_the_whole_and_is_cached_apart(source, tmp_path):
    corpus = open_corpus(source, val_fraction=0.1)
    total = train_bytes(corpus)
    whole = load_or_train_tokenizer(corpus, DataConfig(vocab_size=400), tmp_path / "cache")
    sample_cfg = DataConfig(vocab_size=400, tokenizer_sample_bytes=total // 5)
    sampled = load_or_train_tokenizer(corpus, sample_cfg, tmp_path / "cache")
    assert tokenizer_hash(sampled) != tokenizer_hash(whole)
    assert bpe_cache_path(corpus, sample_cfg, tmp_path) != bpe_cache_path(corpus, DataConfig(vocab_size=400), tmp_path)
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))) == 2
    # Deterministic: trained again elsewhere, the same tokenizer.
    again = load_or_train_tokenizer(open_corpus(source, val_fraction=0.1), sample_cfg, tmp_path / "other")
    assert tokenizer_hash(again) == tokenizer_hash(sampled)
    # A sample that holds the whole split is the whole split's tokenizer.
    full_sample = DataConfig(vocab_size=400, tokenizer_sample_bytes=total)
    assert tokenizer_hash(load_or_train_tokenizer(corpus, full_sample, tmp_path / "cache")) == tokenizer_hash(whole)


def test_prepare_with_a_sampled_tokenizer(source, tmp_path, capsys):
    corpus = open_corpus(source, val_fraction=0.1)
    cfg = DataConfig(
        source=source,
        cache_dir=str(tmp_path / "cache"),
        vocab_size=400,
        val_fraction=0.1,
        prepare_workers=1,
        tokenizer_sample_bytes=train_bytes(corpus) // 5,
    )
    p = prepare(cfg)
    assert "on a sample of up to" in capsys.readouterr().err
    assert p.tokenized and p.manifest["splits"]["train"]["documents"] == corpus.count("train")
    text = p.tokenizer.decode(list(p.tokens("val")), skip_special_tokens=True)
    assert text == "".join(t for _, t in corpus.documents("val"))  # byte-level: every text comes back
    assert not prepare(cfg, progress=False).tokenized
