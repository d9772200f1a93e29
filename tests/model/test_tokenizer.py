"""Tokenizers: lossless round trips, exact vocabulary sizes, cache reuse, byte fallback."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gwtf.config import DataConfig
from gwtf.model.tokenizer import (
    BYTE_VOCAB_SIZE,
    BpeTokenizer,
    ByteTokenizer,
    load_or_train_tokenizer,
    train_bpe,
    vocab_size_for,
)

SAMPLES = ["Hello, world!", "  two  spaces\n\nand lines\t", "naïve café — ünïcödé ✓ 日本語", "", "x" * 300]


def _rich_corpus(n_words: int = 4000, seed: int = 0) -> list[str]:
    """Many distinct made-up words, so BPE can fill a small vocabulary completely."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(800)]
    return [" ".join(rng.choice(words) for _ in range(20)) + "." for _ in range(n_words // 20)]


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return train_bpe(_rich_corpus(), vocab_size=400)


def test_bpe_has_exactly_the_requested_vocabulary(bpe: BpeTokenizer) -> None:
    assert bpe.vocab_size == 400 and bpe.trained_vocab_size == 400
    ids = [i for t in _rich_corpus(seed=1) for i in bpe.encode(t)]
    assert max(ids) < 400 and bpe.eot_id == 0


@pytest.mark.parametrize("text", SAMPLES)
def test_bpe_round_trip_is_lossless(bpe: BpeTokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_compresses_its_training_text(bpe: BpeTokenizer) -> None:
    text = _rich_corpus()[0]
    assert len(bpe.encode(text)) < 0.85 * len(text.encode())  # 143 merges on random words: modest


def test_bpe_training_is_deterministic() -> None:
    a, b = train_bpe(_rich_corpus(), 300), train_bpe(_rich_corpus(), 300)
    text = " ".join(_rich_corpus(seed=2))
    assert a.encode(text) == b.encode(text)


def test_tokenizer_is_cached_by_corpus_hash_and_vocab(tmp_path: Path) -> None:
    cfg = DataConfig(vocab_size=300)
    texts = _rich_corpus()
    first = load_or_train_tokenizer(cfg, texts, "ab" * 32, tmp_path)
    files = list(tmp_path.glob("tokenizer-bpe-v300-*.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    again = load_or_train_tokenizer(cfg, texts, "ab" * 32, tmp_path)
    assert files[0].stat().st_mtime_ns == stamp  # reused, not retrained
    assert again.encode("some text here") == first.encode("some text here")
    load_or_train_tokenizer(DataConfig(vocab_size=280), texts, "ab" * 32, tmp_path)
    assert len(list(tmp_path.glob("tokenizer-bpe-*.json"))) == 2


def test_broken_cached_tokenizer_is_rebuilt(tmp_path: Path) -> None:
    cfg = DataConfig(vocab_size=300)
    load_or_train_tokenizer(cfg, _rich_corpus(), "cd" * 32, tmp_path)
    path = next(tmp_path.glob("tokenizer-bpe-*.json"))
    path.write_text("{ not json")
    tok = load_or_train_tokenizer(cfg, _rich_corpus(), "cd" * 32, tmp_path)
    assert tok.decode(tok.encode("hello")) == "hello"


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids + [tok.eot_id]) == text


def test_byte_fallback_is_chosen_by_config(tmp_path: Path) -> None:
    cfg = DataConfig(tokenizer="byte")
    tok = load_or_train_tokenizer(cfg, ["ignored"], "ef" * 32, tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == BYTE_VOCAB_SIZE == 257
    assert not list(tmp_path.iterdir())  # nothing to train or cache
    assert vocab_size_for(cfg) == 257 and vocab_size_for(DataConfig(vocab_size=999)) == 999
