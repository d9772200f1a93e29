"""`prepare`: tokenize a path corpus once, streaming and in parallel, into a memory-mapped token
file plus a manifest, and reuse it while the corpus is unchanged.

Owns: the prepared folder `CACHE/files/prepared-<tokenizer cache key>-<source id>/`
(`tokens.npy`: every document's tokens followed by end-of-text, uint16 or uint32; `counts.npy`:
token counts per id; `manifest.json`, written last), the reuse check (file names, sizes and
mtimes against the manifest, no re-hashing), the split into units (byte ranges of plain files,
row groups of parquet files, whole .gz files; fixed by the files and `unit_bytes`, never by the
worker count, so the output does not depend on it), the spawned worker pool (one tokenizer per
worker, batch encoding, each unit written incrementally to its own file, then concatenated in
unit order), malformed-record counts with the first offending file:line, and the per-file
sha256 of the manifest. A lock file keeps two processes from preparing one corpus at once.
Must not import torch: the workers are spawned and import this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gwtf.config import DataConfig
from gwtf.errors import UserError
from gwtf.model.corpora import (
    Bad,
    SourceFile,
    docs_sha256,
    iter_texts,
    list_source,
    parquet_row_groups,
    read_sample,
)
from gwtf.model.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, load_or_train_tokenizer
from gwtf.model.tokenizer import cache_key as tokenizer_cache_key

__all__ = ["MANIFEST", "TOKENS", "Prepared", "Unit", "plan_units", "prepare", "prepared_folder"]

MANIFEST_VERSION = 1
MANIFEST, TOKENS, COUNTS = "manifest.json", "tokens.npy", "counts.npy"
UNIT_BYTES = 8 << 20  # a plain file is tokenized in byte ranges of this size
_BATCH_CHARS, _BATCH_TEXTS = 1 << 20, 4096  # texts handed to the tokenizer's batch encoder at once
Say = Callable[[str], None]
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A prepared corpus: its folder, tokenizer and manifest; the tokens are memory-mapped."""

    folder: Path
    tokenizer: Tokenizer
    manifest: dict[str, Any]
    reused: bool

    def tokens(self) -> np.ndarray:
        """All tokens, memory-mapped read-only (nothing is read until it is indexed)."""
        return np.load(self.folder / TOKENS, mmap_mode="r", allow_pickle=False)

    def counts(self) -> np.ndarray:
        """How often each token id occurs in all tokens (int64, vocab_size long)."""
        return np.load(self.folder / COUNTS, allow_pickle=False)


@dataclass(frozen=True, slots=True)
class Unit:
    """One piece of work: a byte range of a plain file, a parquet row group or a whole .gz."""

    index: int
    file: int  # index into the corpus' files
    start: int = 0
    end: int = 0
    row_group: int | None = None
    last: bool = True  # txt: the unit that ends its file appends the end-of-text
    weight: int = 0  # bytes, for the progress bar


@dataclass(slots=True)
class _Result:
    index: int
    tokens: int = 0
    text_tokens: int = 0  # not counting the end-of-text ids
    records: int = 0
    lines: int = 0  # lines (rows) the unit covered, for file-global line numbers
    bad: dict[str, int] = field(default_factory=dict)
    first_bad: Bad | None = None
    error: str | None = None  # a text file's UserError message
    counts: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class _State:
    tokenizer: Tokenizer
    files: tuple[SourceFile, ...]
    text_field: str
    work: Path
    dtype: str


_STATE: _State | None = None  # the worker's, set by _init_worker


def prepared_folder(data_cfg: DataConfig, cache_dir: Path) -> Path:
    """Where `data.source` is prepared for this tokenizer (cache_dir: the corpus cache, CACHE/files)."""
    root = Path(data_cfg.source).expanduser().resolve()
    ident = {"source": str(root), "glob": data_cfg.glob, "text_field": data_cfg.text_field,
             "bpe_sample_mb": data_cfg.bpe_sample_mb if data_cfg.tokenizer == "bpe" else 0}
    sid = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"prepared-{tokenizer_cache_key(data_cfg)}-{sid}"


def prepare(data_cfg: DataConfig, cache_dir: Path, say: Say, progress: Progress | None = None,
            unit_bytes: int = UNIT_BYTES) -> Prepared:
    """The prepared tokens of `data.source`: reused if the manifest matches the files, else made."""
    files = list_source(data_cfg)
    folder = prepared_folder(data_cfg, cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        found = _reuse(folder, data_cfg, files, cache_dir)
        if found is not None:
            return found
        return _prepare_fresh(folder, data_cfg, files, cache_dir, say, progress, unit_bytes)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _listing(files: Sequence[SourceFile]) -> list[dict[str, Any]]:
    return [{"name": f.name, "kind": f.kind, "size": f.size, "mtime_ns": f.mtime_ns} for f in files]


def _tokenizer_id(tok: Tokenizer) -> str:
    to_json = getattr(tok, "to_json", None)
    return "byte" if to_json is None else hashlib.sha256(str(to_json()).encode()).hexdigest()


# ------------------------------------------------------------------------------------------
# Reuse
# ------------------------------------------------------------------------------------------


def _reuse(folder: Path, data_cfg: DataConfig, files: Sequence[SourceFile], cache_dir: Path) -> Prepared | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        same = (manifest["version"] == MANIFEST_VERSION and manifest["tokenizer"]["key"] ==
                tokenizer_cache_key(data_cfg) and [{k: f[k] for k in ("name", "kind", "size", "mtime_ns")}
                                                   for f in manifest["files"]] == _listing(files))
        if not same:
            return None
        tok = _recorded_tokenizer(data_cfg, manifest, cache_dir)
        tokens = np.load(folder / TOKENS, mmap_mode="r", allow_pickle=False)
        counts = np.load(folder / COUNTS, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (tok is None or _tokenizer_id(tok) != manifest["tokenizer"]["sha256"] or tokens.shape != (manifest["tokens"],)
            or str(tokens.dtype) != manifest["dtype"] or counts.shape != (tok.vocab_size,)):
        return None
    return Prepared(folder=folder, tokenizer=tok, manifest=manifest, reused=True)


def _recorded_tokenizer(data_cfg: DataConfig, manifest: dict[str, Any], cache_dir: Path) -> Tokenizer | None:
    if data_cfg.tokenizer != "bpe":
        return load_or_train_tokenizer(data_cfg, [], "", cache_dir)
    try:  # never through load_or_train_tokenizer: it would retrain a broken file on no texts
        return BpeTokenizer.from_file(cache_dir / manifest["tokenizer"]["file"], data_cfg.vocab_size)
    except Exception:  # tokenizers raises its own types for a file it cannot read
        return None


# ------------------------------------------------------------------------------------------
# Preparing
# ------------------------------------------------------------------------------------------


def plan_units(files: Sequence[SourceFile], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of work of a corpus, in output order."""
    units: list[Unit] = []
    for i, sf in enumerate(files):
        if sf.kind == "parquet":
            rows = parquet_row_groups(sf.path)
            total = max(sum(rows), 1)
            for g, n in enumerate(rows):
                units.append(Unit(len(units), i, row_group=g, weight=sf.size * n // total))
        elif sf.kind == "jsonl.gz":
            units.append(Unit(len(units), i, weight=sf.size))
        else:
            starts = range(0, max(sf.size, 1), unit_bytes)
            for s in starts:
                end = min(s + unit_bytes, sf.size)
                units.append(Unit(len(units), i, s, end, last=end >= sf.size, weight=end - s))
    return units


def _sample_tokenizer(data_cfg: DataConfig, files: Sequence[SourceFile], cache_dir: Path) -> tuple[Tokenizer, str]:
    """The tokenizer and, for BPE, the name of its file: trained on the first bpe_sample_mb MB."""
    if data_cfg.tokenizer != "bpe":
        return load_or_train_tokenizer(data_cfg, [], "", cache_dir), ""
    docs = read_sample(files, data_cfg.text_field, data_cfg.bpe_sample_mb << 20)
    sha = docs_sha256(docs)
    tok = load_or_train_tokenizer(data_cfg, [text for _, text in docs], sha, cache_dir)
    return tok, f"tokenizer-bpe-v{data_cfg.vocab_size}-{sha[:16]}.json"


def _prepare_fresh(folder: Path, data_cfg: DataConfig, files: Sequence[SourceFile], cache_dir: Path,
                   say: Say, progress: Progress | None, unit_bytes: int) -> Prepared:
    t0 = time.monotonic()
    tok, bpe_file = _sample_tokenizer(data_cfg, files, cache_dir)
    t_tokenizer = time.monotonic()
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    units = plan_units(files, unit_bytes)
    for stale in folder.glob("work-*"):  # left by a killed run (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    work = folder / f"work-{os.getpid()}"
    work.mkdir()
    try:
        state = _State(tokenizer=tok, files=tuple(files), text_field=data_cfg.text_field, work=work, dtype=dtype)
        workers = min(data_cfg.prepare_workers or len(os.sched_getaffinity(0)), max(len(units), 1))
        results, hashes = _run(units, state, workers, progress)
        t_tokenize = time.monotonic()
        manifest = _manifest(data_cfg, files, units, results, hashes, tok, bpe_file, dtype)
        _check(manifest, results, data_cfg)
        manifest["timing_s"] = {"tokenizer": t_tokenizer - t0, "tokenize": t_tokenize - t_tokenizer,
                                "write": 0.0, "workers": workers}
        _write(folder, work, units, results, manifest, tok.vocab_size, t_tokenize)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall, busy = time.monotonic() - t0, max(t_tokenize - t_tokenizer, 1e-9)
    mb = sum(f.size for f in files) / 1e6
    say(f"data: prepared {data_cfg.source}: {len(files)} files, {mb:.1f} MB, {manifest['records']} records -> "
        f"{manifest['tokens']} tokens in {wall:.1f} s (tokenizing {busy:.1f} s on {workers} "
        f"worker{'s' if workers > 1 else ''}: {manifest['tokens'] / busy / workers:,.0f} tokens/s per worker) "
        f"into {folder}")
    if manifest["malformed"]:
        say(f"warning: {malformed_summary(manifest)}")
    return Prepared(folder=folder, tokenizer=tok, manifest=manifest, reused=False)


def _run(units: Sequence[Unit], state: _State, workers: int,
         progress: Progress | None) -> tuple[list[_Result], list[str]]:
    """Every unit's result (in unit order) and every file's sha256, on `workers` processes."""
    jobs: list[Unit | int] = [*units, *range(len(state.files))]  # ints: hash that file
    total = sum(u.weight for u in units)
    done = 0
    if progress is not None:
        progress(0, total)
    out: dict[int, _Result] = {}
    hashes: dict[int, str] = {}

    def record(got: _Result | tuple[int, str]) -> None:
        nonlocal done
        if isinstance(got, _Result):
            out[got.index] = got
            done += units[got.index].weight
            if progress is not None:
                progress(done, total)
        else:
            hashes[got[0]] = got[1]

    if workers <= 1:
        global _STATE
        _STATE = state
        try:
            for job in jobs:
                record(_run_job(job))
        finally:
            _STATE = None
    else:
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (state,)) as pool:
            for got in pool.imap_unordered(_run_job, jobs):
                record(got)
    return [out[i] for i in range(len(units))], [hashes[i] for i in range(len(state.files))]


def _init_worker(state: _State) -> None:
    global _STATE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _STATE = state


def _run_job(job: Unit | int) -> _Result | tuple[int, str]:
    assert _STATE is not None
    if isinstance(job, int):
        return job, _file_sha256(_STATE.files[job].path)
    return _tokenize_unit(_STATE, job)


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class _Encoder:
    """Batches texts for the tokenizer's batch encoder and appends the ids to a unit's file."""

    def __init__(self, tok: Tokenizer, dtype: str, out: BinaryIO, eot_each: bool) -> None:
        self.tok, self.dtype, self.out, self.eot_each = tok, np.dtype(dtype), out, eot_each
        self.batch: list[str] = []
        self.chars = 0
        self.tokens = self.text_tokens = 0
        self.counts = np.zeros(tok.vocab_size, np.int64)

    def add(self, text: str) -> None:
        self.batch.append(text)
        self.chars += len(text)
        if self.chars >= _BATCH_CHARS or len(self.batch) >= _BATCH_TEXTS:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            self._emit(self._encode(self.batch), eots=len(self.batch) if self.eot_each else 0)
        self.batch, self.chars = [], 0

    def end_of_text(self) -> None:
        self._emit(np.asarray([self.tok.eot_id], self.dtype), eots=1)

    def _encode(self, texts: list[str]) -> np.ndarray:
        eot = [self.tok.eot_id] if self.eot_each else []
        if isinstance(self.tok, ByteTokenizer):  # the same ids as encode_many, without Python int lists
            eot_arr = np.asarray(eot, self.dtype)
            parts = [p for t in texts for p in (np.frombuffer(t.encode("utf-8"), np.uint8), eot_arr)]
            return np.concatenate(parts).astype(self.dtype, copy=False)
        flat: list[int] = []
        for ids in self.tok.encode_many(texts):
            flat += ids
            flat += eot
        return np.asarray(flat, self.dtype)

    def _emit(self, ids: np.ndarray, eots: int) -> None:
        self.out.write(ids.tobytes())
        self.tokens += len(ids)
        self.text_tokens += len(ids) - eots
        self.counts += np.bincount(ids, minlength=len(self.counts))


def _tokenize_unit(state: _State, unit: Unit) -> _Result:
    sf = state.files[unit.file]
    res = _Result(unit.index)
    with open(state.work / f"unit-{unit.index:06d}.bin", "wb") as out:
        enc = _Encoder(state.tokenizer, state.dtype, out, eot_each=sf.kind != "txt")
        try:
            for line_no, got in iter_texts(sf, state.text_field, unit.start, unit.end, unit.row_group):
                res.lines = line_no
                if isinstance(got, Bad):
                    res.bad[got.reason] = res.bad.get(got.reason, 0) + 1
                    res.first_bad = res.first_bad or got
                elif got:
                    res.records += 1
                    enc.add(got)
            enc.flush()
            if sf.kind == "txt" and unit.last:
                enc.end_of_text()  # a text file is one document
        except UserError as exc:
            res.error = str(exc)
    res.tokens, res.text_tokens, res.counts = enc.tokens, enc.text_tokens, enc.counts
    return res


# ------------------------------------------------------------------------------------------
# Manifest, checks, output
# ------------------------------------------------------------------------------------------


def _manifest(data_cfg: DataConfig, files: Sequence[SourceFile], units: Sequence[Unit], results: Sequence[_Result],
              hashes: Sequence[str], tok: Tokenizer, bpe_file: str, dtype: str) -> dict[str, Any]:
    per_file = [{**row, "sha256": sha, "tokens": 0, "records": 0, "malformed": 0}
                for row, sha in zip(_listing(files), hashes)]
    lines_before = [0] * len(files)  # lines (rows) of earlier units of the same file
    bad: dict[str, int] = {}
    first_bad = ""
    for unit, res in zip(units, results):
        row = per_file[unit.file]
        row["tokens"] += res.tokens
        row["records"] += res.records
        row["malformed"] += sum(res.bad.values())
        for reason, n in res.bad.items():
            bad[reason] = bad.get(reason, 0) + n
        if res.first_bad is not None and not first_bad:
            line = res.first_bad.line + lines_before[unit.file]
            first_bad = f"{files[unit.file].name}:{line} ({res.first_bad.reason})"
        lines_before[unit.file] += res.lines
    return {
        "version": MANIFEST_VERSION, "source": data_cfg.source, "glob": data_cfg.glob,
        "text_field": data_cfg.text_field, "dtype": dtype,
        "tokenizer": {"key": tokenizer_cache_key(data_cfg), "sha256": _tokenizer_id(tok), "file": bpe_file,
                      "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
                      "bpe_sample_mb": data_cfg.bpe_sample_mb if bpe_file else 0},
        "tokens": sum(r.tokens for r in results), "text_tokens": sum(r.text_tokens for r in results),
        "records": sum(r.records for r in results), "malformed": dict(sorted(bad.items())),
        "first_malformed": first_bad, "files": per_file,
    }


def malformed_summary(manifest: dict[str, Any]) -> str:
    """'N malformed records skipped (reason: n, ...); first: file:line (reason)', or ''."""
    bad: dict[str, int] = manifest["malformed"]
    if not bad:
        return ""
    kinds = ", ".join(f"{reason}: {n}" for reason, n in bad.items())
    return f"{sum(bad.values())} malformed records skipped ({kinds}); first: {manifest['first_malformed']}"


def _check(manifest: dict[str, Any], results: Sequence[_Result], data_cfg: DataConfig) -> None:
    error = next((r.error for r in results if r.error is not None), None)
    if error is not None:
        raise UserError(error)
    if manifest["text_tokens"] == 0:
        why = malformed_summary(manifest) or "only empty texts"
        raise UserError(f"data path {data_cfg.source} yields no tokens: {manifest['records']} records, {why}")


def _write(folder: Path, work: Path, units: Sequence[Unit], results: Sequence[_Result],
           manifest: dict[str, Any], vocab_size: int, t_start: float) -> None:
    """tokens.npy (the units' files concatenated in order), counts.npy, then the manifest."""
    (folder / MANIFEST).unlink(missing_ok=True)  # until the new one is written, nothing is reused
    tmp = folder / f"{TOKENS}.tmp{os.getpid()}"
    with open(tmp, "wb") as out:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(manifest["dtype"])),
                  "fortran_order": False, "shape": (manifest["tokens"],)}
        np.lib.format.write_array_header_1_0(out, header)
        for unit in units:
            part = work / f"unit-{unit.index:06d}.bin"
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
            part.unlink()
    os.replace(tmp, folder / TOKENS)
    counts = np.zeros(vocab_size, np.int64)
    for res in results:
        assert res.counts is not None
        counts += res.counts
    tmp_counts = folder / f"counts.tmp{os.getpid()}.npy"
    np.save(tmp_counts, counts, allow_pickle=False)
    os.replace(tmp_counts, folder / COUNTS)
    manifest["timing_s"]["write"] = time.monotonic() - t_start
    tmp_manifest = folder / f"{MANIFEST}.tmp{os.getpid()}"
    tmp_manifest.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(tmp_manifest, folder / MANIFEST)
