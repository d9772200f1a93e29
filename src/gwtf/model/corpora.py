"""Path corpora: `.txt`, `.jsonl`, `.jsonl.gz` and `.parquet` files, and folders of them.

Owns: listing a source's files (`data.glob`, sorted, each stat'ed and opened once so an
unreadable file is a one-line error before any work), reading a byte range / row group / whole
file incrementally as texts (plain text as lines, records as one text each), the checks that
refuse a binary or non-UTF-8 text file, the malformed-record classification of jsonl and parquet
(bad JSON, missing field, not a string, not UTF-8: counted by the caller, never fatal), the
bounded BPE training sample and `docs_sha256`, the corpus hash of named documents.
Must not import torch: spawned prepare workers (`gwtf.model.prepare`) import this module.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from gwtf.config import DataConfig
from gwtf.errors import UserError

__all__ = [
    "DEFAULT_GLOBS",
    "Bad",
    "SourceFile",
    "check_text",
    "docs_sha256",
    "file_kind",
    "iter_texts",
    "list_source",
    "read_sample",
]

Kind = Literal["txt", "jsonl", "jsonl.gz", "parquet"]
DEFAULT_GLOBS = ("*.txt", "*.jsonl", "*.jsonl.gz", "*.parquet")
PYARROW_HINT = "pip install pyarrow, or pip install 'gwtf[parquet]'"
_BLOCK_BYTES = 1 << 20  # plain files are read in blocks of whole lines of about this size
# control bytes no text file holds (tab, newline, vertical tab, form feed, CR and ESC are fine)
_BINARY_BYTE = re.compile(rb"[\x00-\x08\x0e-\x1a\x1c-\x1f]")


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file of a corpus, as listed (size and mtime are what the reuse check compares)."""

    path: Path
    name: str  # path relative to the source folder (posix), the bare name for a single file
    kind: Kind
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Bad:
    """A malformed record: its 1-based line (row) within what was read, and why."""

    line: int
    reason: str


def file_kind(path: Path) -> Kind:
    """The reader a file gets, by its suffix; anything unknown is plain text."""
    name = path.name.lower()
    if name.endswith(".jsonl.gz"):
        return "jsonl.gz"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "txt"


def docs_sha256(docs: Sequence[tuple[str, str]]) -> str:
    """The hash of named documents (what BPE files are keyed by): sha256 of name NUL text NUL..."""
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


def list_source(data_cfg: DataConfig) -> list[SourceFile]:
    """The files `data.source` names, in sorted order (UserError if missing, empty or unreadable)."""
    root = Path(data_cfg.source).expanduser()
    if not root.exists():
        raise UserError(f"data path not found: {root}")
    patterns = (data_cfg.glob,) if data_cfg.glob else DEFAULT_GLOBS
    if root.is_file():
        found = [(root, root.name)]
    else:
        hits = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
        found = sorted(((p, p.relative_to(root).as_posix()) for p in hits), key=lambda pn: pn[1])
    if not found:
        raise UserError(f"data path holds no {' / '.join(patterns)} files: {root}")
    return [_source_file(path, name) for path, name in found]


def _source_file(path: Path, name: str) -> SourceFile:
    try:
        st = path.stat()
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise UserError(f"cannot read data file {path}: {exc.strerror}") from None
    kind = file_kind(path)
    if kind == "parquet":
        _pyarrow_parquet(path)
    return SourceFile(path=path, name=name, kind=kind, size=st.st_size, mtime_ns=st.st_mtime_ns)


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"data file {path} is parquet: reading it needs pyarrow ({PYARROW_HINT})") from None
    return pq


# ------------------------------------------------------------------------------------------
# Plain text: strict checks, lines
# ------------------------------------------------------------------------------------------


def check_text(path: Path, data: bytes, offset: int = 0) -> str:
    """`data` (bytes of `path` from `offset` on) as text; UserError naming the file and the byte
    offset if it is binary (a NUL or other control byte) or not UTF-8."""
    bad = _BINARY_BYTE.search(data)
    if bad is not None:
        at = bad.start()
        raise UserError(f"data file {path} is binary, not text: byte 0x{data[at]:02x} at offset {offset + at}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"data file {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset "
                        f"{offset + exc.start} (convert it, e.g. `iconv -f latin1 -t utf-8`)") from None


def _line_blocks(f: BinaryIO, start: int, end: int) -> Iterator[tuple[int, list[bytes]]]:
    """(offset of the first line, lines) for the lines that start in [start, end), in blocks.

    A line belongs to the range holding its first byte, so ranges cut anywhere partition a
    file's lines exactly."""
    if start > 0:
        f.seek(start - 1)
        f.readline()  # the rest of the line holding byte start-1 belongs to the previous range
    pos = f.tell()
    while pos < end:
        lines = f.readlines(_BLOCK_BYTES)
        if not lines:
            return
        first, keep = pos, []
        for line in lines:
            if pos >= end:
                break
            keep.append(line)
            pos += len(line)
        yield first, keep


# ------------------------------------------------------------------------------------------
# Records: jsonl, jsonl.gz, parquet
# ------------------------------------------------------------------------------------------


def _record_text(line: bytes, field: str) -> str | Bad:
    """The text of one jsonl line, or why it is malformed (`Bad.line` is filled by the caller)."""
    try:
        raw = line.decode("utf-8")
    except UnicodeDecodeError:
        return Bad(0, "not UTF-8")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return Bad(0, "bad JSON")
    return _field_text(obj.get(field) if isinstance(obj, dict) else None, field)


def _field_text(value: object, field: str) -> str | Bad:
    if value is None:
        return Bad(0, f'missing field "{field}"')
    if not isinstance(value, str):
        return Bad(0, f'field "{field}" is not a string')
    try:
        value.encode("utf-8")  # JSON escapes can spell lone surrogates, which no tokenizer takes
    except UnicodeEncodeError:
        return Bad(0, "not UTF-8")
    return value


def iter_texts(sf: SourceFile, field: str, start: int = 0, end: int | None = None,
               row_group: int | None = None) -> Iterator[tuple[int, str | Bad]]:
    """(1-based line or row number within the part read, text or Bad) of one part of a file.

    txt: every line as text (the strict checks raise UserError); jsonl: byte range [start, end);
    jsonl.gz: the whole file; parquet: one row group (all of them if None). Blank jsonl lines are
    yielded as "" (so the last number is the count of lines read)."""
    stop = sf.size if end is None else end
    if sf.kind == "parquet":
        yield from _parquet_texts(sf.path, field, row_group)
        return
    if sf.kind == "jsonl.gz":
        with gzip.open(sf.path, "rb") as gz:
            yield from _jsonl_texts(_gz_blocks(gz, sf.path), field)
        return
    with open(sf.path, "rb") as f:
        if sf.kind == "jsonl":
            yield from _jsonl_texts(_line_blocks(f, start, stop), field)
            return
        line_no = 0
        for offset, lines in _line_blocks(f, start, stop):
            text = check_text(sf.path, b"".join(lines), offset)
            for piece in text.splitlines(keepends=True):  # only at line ends: the blocks end at "\n"
                line_no += 1
                yield line_no, piece


def _gz_blocks(gz: gzip.GzipFile, path: Path) -> Iterator[tuple[int, list[bytes]]]:
    try:
        while lines := gz.readlines(_BLOCK_BYTES):
            yield 0, lines
    except (OSError, EOFError) as exc:
        raise UserError(f"cannot read data file {path}: {exc}") from None


def _jsonl_texts(blocks: Iterator[tuple[int, list[bytes]]], field: str) -> Iterator[tuple[int, str | Bad]]:
    line_no = 0
    for _, lines in blocks:
        for line in lines:
            line_no += 1
            if line.isspace():
                yield line_no, ""
                continue
            got = _record_text(line, field)
            yield line_no, (Bad(line_no, got.reason) if isinstance(got, Bad) else got)


def parquet_row_groups(path: Path) -> list[int]:
    """Rows per row group of a parquet file."""
    pq = _pyarrow_parquet(path)
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises its own types for a file that is not parquet
        raise UserError(f"data file {path} is not a readable parquet file ({exc})") from None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _parquet_texts(path: Path, field: str, row_group: int | None) -> Iterator[tuple[int, str | Bad]]:
    pq = _pyarrow_parquet(path)
    try:
        pf = pq.ParquetFile(path)
        groups = list(range(pf.num_row_groups)) if row_group is None else [row_group]
        if field not in pf.schema_arrow.names:
            rows = sum(pf.metadata.row_group(g).num_rows for g in groups)
            for row in range(1, rows + 1):
                yield row, Bad(row, f'missing field "{field}"')
            return
        row = 0
        for batch in pf.iter_batches(batch_size=4096, row_groups=groups, columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                got = _field_text(value, field)
                yield row, (Bad(row, got.reason) if isinstance(got, Bad) else got)
    except UserError:
        raise
    except Exception as exc:  # pyarrow's own error types
        raise UserError(f"cannot read parquet file {path}: {str(exc).splitlines()[0][:200]}") from None


# ------------------------------------------------------------------------------------------
# The BPE training sample
# ------------------------------------------------------------------------------------------


def read_sample(files: Sequence[SourceFile], field: str, budget_bytes: int) -> list[tuple[str, str]]:
    """The first `budget_bytes` of text of the corpus as named documents, what the BPE trains on.

    A text file that fits whole is one document (so a small corpus is sampled whole, exactly as
    it was read before streaming existed); a record is one document named "file:line"; the last
    document is cut at a line (record) boundary once the budget is spent. Malformed records are
    skipped (prepare counts them)."""
    docs: list[tuple[str, str]] = []
    left = budget_bytes
    for sf in files:
        if left <= 0:
            break
        if sf.kind == "txt":
            text, used = _txt_prefix(sf, left)
            docs.append((sf.name, text))
            left -= used
            continue
        for line_no, got in iter_texts(sf, field):
            if isinstance(got, Bad) or not got:
                continue
            docs.append((f"{sf.name}:{line_no}", got))
            left -= len(got.encode("utf-8"))
            if left <= 0:
                break
    return docs


def _txt_prefix(sf: SourceFile, budget: int) -> tuple[str, int]:
    """A text file whole if it fits the budget, else its first whole lines within it."""
    with open(sf.path, "rb") as f:
        if sf.size <= budget:
            data = f.read()
            return check_text(sf.path, data), len(data)
        parts: list[bytes] = []
        used = 0
        for _, lines in _line_blocks(f, 0, sf.size):
            for line in lines:
                if used + len(line) > budget and parts:
                    return check_text(sf.path, b"".join(parts)), used
                parts.append(line)
                used += len(line)
    return check_text(sf.path, b"".join(parts)), used
