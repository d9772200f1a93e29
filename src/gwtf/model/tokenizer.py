"""Tokenizers: byte-level BPE trained offline with `tokenizers`, a plain byte fallback, and a
user's own tokenizer file.

Owns: the `Tokenizer` protocol, `ByteTokenizer` (256 byte ids + `<|endoftext|>` = 256),
`BpeTokenizer` (byte-level BPE; `<|endoftext|>` = 0), training a BPE on a corpus and caching
the result as JSON keyed by corpus hash + vocab size, `FileTokenizer` (`data.tokenizer` = a path:
a tokenizer.json or a Hugging Face folder holding one), `vocab_size_for(data_cfg)`, the
vocabulary size a model must be built with (known without reading any data, so the simulator
can size models too), and `cache_key(data_cfg)`, the tag naming a tokenizer in token caches.
The byte and BPE tokenizers are lossless: `decode(encode(s)) == s` for any str.
A `FileTokenizer`'s end-of-text id is the tokenizer's own: the `eos_token` of the folder's
tokenizer_config.json / special_tokens_map.json, else the first of `EOT_CANDIDATES` it knows.
It encodes without the pipeline's special tokens (no BOS): data loading separates documents with
the end-of-text id itself.
Must not import torch or the network; training is offline.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from gwtf.config import DataConfig
from gwtf.errors import UserError

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOT",
    "EOT_CANDIDATES",
    "BpeTokenizer",
    "ByteTokenizer",
    "FileTokenizer",
    "Tokenizer",
    "cache_key",
    "is_tokenizer_path",
    "load_or_train_tokenizer",
    "load_tokenizer_file",
    "train_bpe",
    "vocab_size_for",
]

EOT = "<|endoftext|>"  # document separator
BYTE_VOCAB_SIZE = 257  # 256 byte values + EOT
# end-of-text tokens of common tokenizers (GPT-2, Llama 3, Llama 1/2 and SentencePiece, Gemma), in
# the order they are looked for when no tokenizer_config.json names the eos token
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_JSON = "tokenizer.json"
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # copied along with tokenizer.json


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


class FileTokenizer:
    """A `tokenizers` pipeline read from a tokenizer.json (with the tokenizer_config.json and
    special_tokens_map.json beside it, if any), e.g. a Hugging Face model's own tokenizer.

    `vocab_size` is the highest token id + 1 (added tokens included); `eot_id` is the
    tokenizer's end-of-text token (module docstring). Encoding adds no special tokens.
    """

    def __init__(self, inner: object, eot_token: str, json_text: str, side_files: dict[str, str],
                 where: str) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        assert isinstance(inner, HfTokenizer)
        self._inner = inner
        eot = inner.token_to_id(eot_token)
        if eot is None:
            raise UserError(f"tokenizer {where}: its end-of-text token {eot_token!r} is not in its vocabulary")
        self._eot_id = int(eot)
        self.eot_token = eot_token
        self.json_text = json_text  # the tokenizer.json as read (what an export writes back)
        self.side_files = side_files  # file name -> text, of SIDE_FILES found beside it
        self.where = where
        self._vocab_size = max(inner.get_vocab(with_added_tokens=True).values()) + 1
        self.sha256 = hashlib.sha256(json_text.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eot_id(self) -> int:
        return self._eot_id

    def to_json(self) -> str:
        return self.json_text

    def encode(self, text: str) -> list[int]:
        return list(self._inner.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        batch = self._inner.encode_batch(list(texts), add_special_tokens=False)  # type: ignore[attr-defined]
        return [list(e.ids) for e in batch]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._inner.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]


def is_tokenizer_path(name: str) -> bool:
    """Whether `data.tokenizer` names a file or folder (anything but "bpe" and "byte")."""
    return name not in ("bpe", "byte")


def _special_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str) and value["content"]:
        return str(value["content"])
    return None


def _eot_token(inner: Any, side_files: dict[str, str], where: str) -> str:
    for name in SIDE_FILES:
        if name in side_files:
            try:
                data = json.loads(side_files[name])
            except json.JSONDecodeError as exc:
                raise UserError(f"tokenizer {where}: {name} is not JSON ({exc})") from None
            token = _special_name(data.get("eos_token")) if isinstance(data, dict) else None
            if token is not None:
                return token
    for token in EOT_CANDIDATES:
        if inner.token_to_id(token) is not None:
            return token
    raise UserError(f"tokenizer {where}: no end-of-text token (no eos_token in {' or '.join(SIDE_FILES)}, and "
                    f"none of {', '.join(EOT_CANDIDATES)} in its vocabulary)")


def load_tokenizer_file(path: str | Path) -> FileTokenizer:
    """The tokenizer at `path`: a tokenizer.json file or a folder holding one (UserError naming
    the path when there is none or it does not parse). Cached while the file is unchanged."""
    p = Path(path).expanduser()
    file = p / TOKENIZER_JSON if p.is_dir() else p
    if not file.is_file():
        what = f"no {TOKENIZER_JSON} in the folder" if p.is_dir() else "no such file or folder"
        raise UserError(f"tokenizer {p}: {what} (data.tokenizer is \"bpe\", \"byte\", a tokenizer.json or a "
                        f"folder holding one)")
    stamp = tuple((q.stat().st_mtime_ns, q.stat().st_size) if q.is_file() else None
                  for q in (file, *(file.parent / name for name in SIDE_FILES)))
    return _load_file(str(file.resolve()), stamp)


@functools.lru_cache(maxsize=8)
def _load_file(file: str, stamp: tuple[tuple[int, int] | None, ...]) -> FileTokenizer:
    """(`stamp`: the files' mtimes and sizes, so a changed file is read again.)"""
    from tokenizers import Tokenizer as HfTokenizer

    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
        inner = HfTokenizer.from_str(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"tokenizer {path}: cannot read it ({exc})") from None
    except Exception as exc:  # tokenizers raises its own exception type for a JSON it cannot parse
        raise UserError(f"tokenizer {path}: not a `tokenizers` JSON ({str(exc).splitlines()[0][:200]})") from None
    side = {}
    for name in SIDE_FILES:
        try:
            side[name] = (path.parent / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    return FileTokenizer(inner, _eot_token(inner, side, str(path)), text, side, str(path))


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
    """The vocabulary size a model is built with for this data config (no data is read; a
    tokenizer file is)."""
    if is_tokenizer_path(data_cfg.tokenizer):
        return load_tokenizer_file(data_cfg.tokenizer).vocab_size
    return BYTE_VOCAB_SIZE if data_cfg.tokenizer == "byte" else data_cfg.vocab_size


def cache_key(data_cfg: DataConfig) -> str:
    """The tag naming this tokenizer in token-cache file names ("byte", "bpe-v2048",
    "file-<sha256[:16] of the tokenizer.json>-e<end-of-text id>"): two configs with the same key
    tokenize every corpus identically."""
    if is_tokenizer_path(data_cfg.tokenizer):
        tok = load_tokenizer_file(data_cfg.tokenizer)
        return f"file-{tok.sha256[:16]}-e{tok.eot_id}"
    return "byte" if data_cfg.tokenizer == "byte" else f"bpe-v{data_cfg.vocab_size}"


def load_or_train_tokenizer(
    data_cfg: DataConfig, texts: Sequence[str], corpus_sha: str, cache_dir: Path
) -> Tokenizer:
    """The tokenizer for this corpus: byte, the file `data.tokenizer` names, or BPE loaded from /
    trained into `cache_dir`.

    The BPE file is keyed by corpus hash and vocab size, so a second run reuses it. A cached file
    that cannot be read is retrained and overwritten (it is derived data).
    """
    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    if is_tokenizer_path(data_cfg.tokenizer):
        return load_tokenizer_file(data_cfg.tokenizer)
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
