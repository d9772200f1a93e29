"""Path corpora and `gwtf data prepare`: jsonl / jsonl.gz / parquet / txt files and folders,
malformed records, the no-token and unreadable-file errors, determinism over workers and unit
sizes, reuse of prepared tokens, and the .txt path giving the tokens it gave before streaming.

Expected tokens are computed here from the records with the byte tokenizer (UTF-8 bytes, EOT =
256), not taken from the code under test.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from cli_errors import assert_one_line_error, gwtf
from gwtf.config import DataConfig, ModelConfig
from gwtf.errors import UserError
from gwtf.model.corpora import docs_sha256
from gwtf.model.data import _encode_docs, load_corpus, load_dataset, prepare_corpus, synthetic_corpus
from gwtf.model.prepare import TOKENS, prepare
from gwtf.model.tokenizer import ByteTokenizer, load_or_train_tokenizer

SMALL = ModelConfig(seq_len=16, microbatch_size=4)
EOT = 256
QUIET = {"say": lambda _: None}


def _byte_tokens(texts: list[str]) -> list[int]:
    return [t for text in texts for t in [*text.encode("utf-8"), EOT]]


def _cfg(tmp_path: Path, source: Path, **kw: object) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), tokenizer="byte", **kw)  # type: ignore[arg-type]


def _records(n: int, seed: int = 0, words_each: int = 7) -> list[str]:
    words = synthetic_corpus(40_000, seed=seed).split()
    room = len(words) - words_each
    return [" ".join(words[i * 13 % room:][:words_each]) + (" é" if i % 5 == 0 else "") for i in range(n)]


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_jsonl_records_become_documents(tmp_path: Path) -> None:
    texts = _records(300)
    src = _write_jsonl(tmp_path / "corpus.jsonl", texts)
    prepared = prepare_corpus(_cfg(tmp_path, src), **QUIET)
    assert prepared.tokens().tolist() == _byte_tokens(texts)
    assert prepared.manifest["records"] == 300 and prepared.manifest["malformed"] == {}
    ds = load_dataset(_cfg(tmp_path, src), SMALL, 0, 2, microbatches=4, **QUIET)
    assert isinstance(ds.train, np.memmap)  # training reads the prepared file through a memory map
    assert np.concatenate([ds.train, ds.val]).tolist() == _byte_tokens(texts)


def test_jsonl_gz_and_text_field(tmp_path: Path) -> None:
    texts = _records(50)
    lines = "".join(json.dumps({"body": t}) + "\n" for t in texts).encode()
    src = tmp_path / "c.jsonl.gz"
    src.write_bytes(gzip.compress(lines))
    prepared = prepare_corpus(_cfg(tmp_path, src, text_field="body"), **QUIET)
    assert prepared.tokens().tolist() == _byte_tokens(texts)


def test_parquet_row_groups_and_null_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts: list[str | None] = [*_records(30)]
    texts[17] = None
    src = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": texts, "n": list(range(30))}), src, row_group_size=8)
    prepared = prepare_corpus(_cfg(tmp_path, src), **QUIET)
    assert prepared.tokens().tolist() == _byte_tokens([t for t in texts if t is not None])
    assert prepared.manifest["malformed"] == {'missing field "text"': 1}
    assert prepared.manifest["first_malformed"] == 'c.parquet:18 (missing field "text")'  # row 18 of 4 groups


def test_folder_is_sorted_and_glob_selects(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "b.jsonl", ["bee"])
    (folder / "a.txt").write_text("ay\n")
    _write_jsonl(folder / "sub" / "c.jsonl", ["sea"])
    (folder / "notes.md").write_text("not data")
    prepared = prepare_corpus(_cfg(tmp_path, folder), **QUIET)
    assert [f["name"] for f in prepared.manifest["files"]] == ["a.txt", "b.jsonl"]
    assert prepared.tokens().tolist() == _byte_tokens(["ay\n", "bee"])
    deep = prepare_corpus(_cfg(tmp_path, folder, glob="**/*.jsonl"), **QUIET)
    assert [f["name"] for f in deep.manifest["files"]] == ["b.jsonl", "sub/c.jsonl"]
    assert deep.tokens().tolist() == _byte_tokens(["bee", "sea"])


def test_malformed_records_are_counted_with_the_first_line(tmp_path: Path) -> None:
    """Bad JSON, a missing field, a non-string field and non-UTF-8 bytes are skipped and counted;
    the first is named by its file-global line, also when the file is cut into many units."""
    texts = _records(400)
    good = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    bad = {150: b"{not json\n", 151: b'{"title": "no text"}\n', 260: b'{"text": 5}\n', 300: b'{"text": "caf\xe9"}\n',
           301: b"\n"}
    lines = good[:]
    for at in sorted(bad, reverse=True):
        lines.insert(at, bad[at])
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"".join(lines))
    said: list[str] = []
    prepared = prepare(_cfg(tmp_path, src), tmp_path / "cache", said.append, unit_bytes=997)
    m = prepared.manifest
    assert m["malformed"] == {"bad JSON": 1, 'field "text" is not a string': 1, 'missing field "text"': 1,
                              "not UTF-8": 1}
    assert m["first_malformed"] == "c.jsonl:151 (bad JSON)"  # lines are 1-based
    assert m["records"] == 400 and prepared.tokens().tolist() == _byte_tokens(texts)
    assert any(s.startswith("warning: 4 malformed records skipped") and "c.jsonl:151" in s for s in said)


def test_output_does_not_depend_on_units_or_workers(tmp_path: Path) -> None:
    """Byte ranges cut anywhere and two spawned workers give the tokens one pass gives."""
    folder = tmp_path / "c"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", _records(200, seed=1))
    (folder / "b.txt").write_text(synthetic_corpus(20_000, seed=2), encoding="utf-8")
    one = prepare(_cfg(tmp_path / "x", folder, prepare_workers=1), tmp_path / "x", lambda _: None)
    many = prepare(_cfg(tmp_path / "y", folder, prepare_workers=2), tmp_path / "y", lambda _: None, unit_bytes=4099)
    assert np.array_equal(one.tokens(), many.tokens())
    assert np.array_equal(one.counts(), many.counts())
    assert one.manifest["files"] == many.manifest["files"]


def test_txt_source_gives_the_tokens_and_bpe_it_gave_before(tmp_path: Path) -> None:
    """A text corpus: each file one document, tokenized line by line as the in-memory path did,
    and its BPE keyed by the same corpus hash (so existing tokenizer files are reused)."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(synthetic_corpus(30_000, seed=4).replace("\n\n", "\r\n\n"), encoding="utf-8")
    (folder / "b.txt").write_text("", encoding="utf-8")
    (folder / "c.txt").write_text("last words\u2028and more", encoding="utf-8")
    cfg = DataConfig(source=str(folder), cache_dir=str(tmp_path / "cache"), tokenizer="bpe", vocab_size=300)
    docs = [(p.name, p.read_bytes().decode()) for p in sorted(folder.glob("*.txt"))]
    assert load_corpus(cfg).sha256 == docs_sha256(docs)
    tok = load_or_train_tokenizer(cfg, [t for _, t in docs], docs_sha256(docs), tmp_path / "old")
    prepared = prepare(cfg, tmp_path / "cache" / "files", lambda _: None, unit_bytes=1000)
    assert prepared.tokens().tolist() == _encode_docs(tok, docs).tolist()
    assert prepared.manifest["tokenizer"]["file"] == f"tokenizer-bpe-v300-{docs_sha256(docs)[:16]}.json"
    assert _encode_docs(ByteTokenizer(), docs).tolist() == prepare_corpus(
        _cfg(tmp_path, folder), **QUIET).tokens().tolist()


def test_bpe_trains_on_a_bounded_sample(tmp_path: Path) -> None:
    texts = _records(1500, words_each=200)  # about 1.5 MB
    src = _write_jsonl(tmp_path / "c.jsonl", texts)
    cfg = DataConfig(source=str(src), cache_dir=str(tmp_path / "cache"), vocab_size=300, bpe_sample_mb=1)
    sample = load_corpus(cfg).docs
    assert 0 < len(sample) < len(texts) and sample[0] == ("c.jsonl:1", texts[0])
    assert sum(len(t.encode()) for _, t in sample) >= 1 << 20 > sum(len(t.encode()) for _, t in sample[:-1])
    prepared = prepare_corpus(cfg, **QUIET)
    assert prepared.manifest["records"] == 1500
    assert prepared.manifest["tokenizer"]["file"] == f"tokenizer-bpe-v300-{docs_sha256(sample)[:16]}.json"


def test_a_corpus_without_tokens_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": ""}\n{"title": "x"}\n\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"yields no tokens: 0 records, 1 malformed .*first: c.jsonl:2"):
        prepare_corpus(_cfg(tmp_path, src), **QUIET)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UserError, match="yields no tokens"):
        prepare_corpus(_cfg(tmp_path, empty), **QUIET)


def test_prepare_reuses_unchanged_files_and_redoes_changed_ones(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "c.jsonl", _records(100))
    cfg = _cfg(tmp_path, src)
    first = prepare_corpus(cfg, **QUIET)
    stamp = (first.folder / TOKENS).stat().st_mtime_ns
    again = prepare_corpus(cfg, **QUIET)
    assert again.reused and not first.reused
    assert (again.folder / TOKENS).stat().st_mtime_ns == stamp  # not re-tokenized, not rewritten
    assert again.manifest == first.manifest
    _write_jsonl(src, _records(100, seed=9))
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    changed = prepare_corpus(cfg, **QUIET)
    assert not changed.reused and changed.tokens().tolist() == _byte_tokens(_records(100, seed=9))


def test_unreadable_or_corrupt_files_are_one_line_errors(tmp_path: Path) -> None:
    broken = tmp_path / "c.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"text": "x"}\n' * 1000)[:60])
    proc = gwtf(tmp_path, "data", "prepare", str(broken), "--set", 'data.tokenizer="byte"')
    assert_one_line_error(proc, "cannot read data file", str(broken))
    if os.geteuid() != 0:  # root reads any file
        locked = _write_jsonl(tmp_path / "locked.jsonl", ["x"])
        locked.chmod(0)
        proc = gwtf(tmp_path, "data", "prepare", str(locked), "--set", 'data.tokenizer="byte"')
        assert_one_line_error(proc, "cannot read data file", str(locked))


def test_parquet_without_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    src = tmp_path / "c.parquet"
    src.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"needs pyarrow \(pip install pyarrow, or pip install 'gwtf\[parquet\]'\)"):
        prepare_corpus(_cfg(tmp_path, src), **QUIET)
