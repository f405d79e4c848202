import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kiln.config import DataConfig
from kiln.data import tokenizer as tokmod
from kiln.data.corpus import DataError, open_corpus, split_of
from kiln.data.tokenizer import EOT, eot_id, load_or_train_tokenizer, token_byte_lengths, tokenizer_hash

VAL_ONLY = "zqxjzqxjzqxj"
TRAIN_WORDS = "the quick brown fox jumps over the lazy dog; naïve café résumé 日本語 ✓"


@pytest.fixture
def corpus(tmp_path):
    """A .jsonl whose val documents (known in advance from the name hash) hold a word train never has."""
    lines = []
    for lineno in range(1, 41):
        val = split_of(f"docs:{lineno}", 0.2) == "val"
        text = f"{VAL_ONLY} " * 50 if val else f"{TRAIN_WORDS} {lineno} " * 5
        lines.append(json.dumps({"text": text}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    corpus = open_corpus(str(tmp_path / "data" / "docs.jsonl"), val_fraction=0.2)
    assert corpus.count("val") > 0
    return corpus


def test_bpe_trains_on_train_split_only(corpus, tmp_path):
    tok = load_or_train_tokenizer(corpus, DataConfig(vocab_size=400), tmp_path / "cache")
    assert tok.get_vocab_size() <= 400
    assert tok.token_to_id("Ġquick") is not None  # merged from train text ("Ġ" is the byte-level space)
    assert not any("zq" in token for token in tok.get_vocab())  # merged only if val text was seen
    assert eot_id(tok) == tok.token_to_id(EOT)
    text = f"{TRAIN_WORDS} {VAL_ONLY}"
    assert tok.decode(tok.encode(text).ids) == text


def test_bpe_is_cached(corpus, tmp_path, monkeypatch):
    cfg = DataConfig(vocab_size=300)
    first = load_or_train_tokenizer(corpus, cfg, tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))) == 1

    calls = []
    real_train = tokmod._train_bpe
    monkeypatch.setattr(tokmod, "_train_bpe", lambda *a: calls.append(a) or real_train(*a))
    again = load_or_train_tokenizer(open_corpus(corpus.source, val_fraction=0.2), cfg, tmp_path / "cache")
    assert not calls and tokenizer_hash(again) == tokenizer_hash(first)
    load_or_train_tokenizer(corpus, DataConfig(vocab_size=310), tmp_path / "cache")
    assert len(calls) == 1  # another vocab size is another tokenizer


def test_token_byte_lengths_sum_to_utf8_bytes(corpus, tmp_path):
    tok = load_or_train_tokenizer(corpus, DataConfig(vocab_size=400), tmp_path / "cache")
    lengths = token_byte_lengths(tok)
    assert lengths.dtype.name == "int64" and len(lengths) == tok.get_vocab_size()
    assert lengths[eot_id(tok)] == 0
    for text in [TRAIN_WORDS, "unseen Ünïcödé ✗ 🚀 and\ttabs\n", "x"]:
        ids = tok.encode(text).ids
        assert lengths[ids].sum() == len(text.encode("utf-8"))


def _word_level(tmp_path, specials):
    vocab = {"[UNK]": 0, "hello": 1, "wörld": 2, **{s: 3 + i for i, s in enumerate(specials)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    path = tmp_path / "user-tokenizer.json"
    tok.save(str(path))
    return path


def test_user_tokenizer_file(corpus, tmp_path):
    path = _word_level(tmp_path, ["<pad>", "</s>"])
    tok = load_or_train_tokenizer(corpus, DataConfig(tokenizer=str(path)), tmp_path / "cache")
    assert eot_id(tok) == tok.token_to_id("</s>")
    lengths = token_byte_lengths(tok)
    assert list(lengths) == [5, 5, 6, 0, 0]  # "[UNK]" decodes to its own text
    assert not (tmp_path / "cache").exists()


def test_user_tokenizer_without_eos(tmp_path):
    tok = Tokenizer.from_file(str(_word_level(tmp_path, ["<pad>"])))
    with pytest.raises(DataError, match="no end-of-text token"):
        eot_id(tok)


def test_bad_tokenizer_paths(corpus, tmp_path):
    with pytest.raises(DataError, match="nope.json: tokenizer file not found"):
        load_or_train_tokenizer(corpus, DataConfig(tokenizer=str(tmp_path / "nope.json")), tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json: not a valid Hugging Face tokenizer.json"):
        load_or_train_tokenizer(corpus, DataConfig(tokenizer=str(tmp_path / "bad.json")), tmp_path)
