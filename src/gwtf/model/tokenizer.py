"""Tokenizers: byte-level BPE trained offline with `tokenizers`, and a plain byte fallback.

Owns: the `Tokenizer` protocol, `ByteTokenizer` (256 byte ids + `<|endoftext|>` = 256),
`BpeTokenizer` (byte-level BPE; `<|endoftext|>` = 0), training a BPE on a corpus and caching
the result as JSON keyed by corpus hash + vocab size, and `vocab_size_for(data_cfg)`, the
vocabulary size a model must be built with (known without reading any data, so the simulator
can size models too). Both tokenizers are lossless: `decode(encode(s)) == s` for any str.
Must not import torch or the network; training is offline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from gwtf.config import DataConfig
from gwtf.errors import UserError

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOT",
    "BpeTokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "load_or_train_tokenizer",
    "train_bpe",
    "vocab_size_for",
]

EOT = "<|endoftext|>"  # document separator
BYTE_VOCAB_SIZE = 257  # 256 byte values + EOT


class Tokenizer(Protocol):
    """What data loading needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOT = 256. No training, no files."""

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def eot_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BpeTokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) backed by a `tokenizers.Tokenizer`.

    `vocab_size` is the size the model is built with (the configured size); the trained vocabulary
    can be smaller on a corpus with few distinct words, never larger.
    """

    def __init__(self, inner: object, vocab_size: int) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        assert isinstance(inner, HfTokenizer)
        self._inner = inner
        self._vocab_size = vocab_size
        eot = inner.token_to_id(EOT)
        if eot is None or inner.get_vocab_size() > vocab_size:
            raise ValueError("not a gwtf BPE tokenizer (missing EOT or vocabulary too large)")
        self._eot_id = int(eot)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int) -> BpeTokenizer:
        from tokenizers import Tokenizer as HfTokenizer

        return cls(HfTokenizer.from_file(str(path)), vocab_size)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer JSON atomically (temp file + rename)."""
        p = Path(path)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        self._inner.save(str(tmp))  # type: ignore[attr-defined]
        os.replace(tmp, p)

    def to_json(self) -> str:
        """The `tokenizers` pipeline as JSON text (what `save` writes; tokenizer.json of an export)."""
        return str(self._inner.to_str())  # type: ignore[attr-defined]

    @property
    def trained_vocab_size(self) -> int:
        return int(self._inner.get_vocab_size())  # type: ignore[attr-defined]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eot_id(self) -> int:
        return self._eot_id

    def encode(self, text: str) -> list[int]:
        return list(self._inner.encode(text).ids)  # type: ignore[attr-defined]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._inner.encode_batch(list(texts))]  # type: ignore[attr-defined]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._inner.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]


def train_bpe(texts: Sequence[str], vocab_size: int) -> BpeTokenizer:
    """Train a byte-level BPE with `vocab_size` tokens (EOT included) on `texts`, offline.

    The initial alphabet is all 256 bytes, so any string encodes, and training is deterministic for
    a given corpus (tokenizers breaks ties by byte order, not by a random draw).
    """
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise UserError(f"data.vocab_size {vocab_size} too small for byte-level BPE (need >= 258)")
    inner = HfTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    return BpeTokenizer(inner, vocab_size)


def vocab_size_for(data_cfg: DataConfig) -> int:
    """The vocabulary size a model is built with for this data config (no data is read)."""
    return BYTE_VOCAB_SIZE if data_cfg.tokenizer == "byte" else data_cfg.vocab_size


def cache_key(data_cfg: DataConfig) -> str:
    """The tag naming this tokenizer in token-cache file names ("byte", "bpe-v2048", ...): two
    configs with the same key tokenize every corpus identically."""
    return "byte" if data_cfg.tokenizer == "byte" else f"bpe-v{data_cfg.vocab_size}"


def load_or_train_tokenizer(
    data_cfg: DataConfig, texts: Sequence[str], corpus_sha: str, cache_dir: Path
) -> Tokenizer:
    """The tokenizer for this corpus: byte, or BPE loaded from / trained into `cache_dir`.

    The BPE file is keyed by corpus hash and vocab size, so a second run reuses it. A cached file
    that cannot be read is retrained and overwritten (it is derived data).
    """
    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    path = cache_dir / f"tokenizer-bpe-v{data_cfg.vocab_size}-{corpus_sha[:16]}.json"
    if path.is_file():
        try:
            return BpeTokenizer.from_file(path, data_cfg.vocab_size)
        except Exception:  # a broken cache entry is rebuilt, whatever broke it
            pass
    tok = train_bpe(texts, data_cfg.vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok
