"""Checkpoints: one safetensors file per stage plus a JSON index, written atomically.

Owns: the on-disk layout of `DIR/checkpoint/`:
- `stage<k>-it<t>.safetensors`: everything stage k needs to continue (weights and optimizer
  state, as flat named tensors; the trainer chooses the names);
- `extra-it<t>.safetensors`: run-wide tensors (RNG state);
- `checkpoint.json`: the index (format, iteration, file names with sha256, plus the trainer's
  JSON metadata). It is replaced last with `os.replace`, so it always points at a complete set
  of files: a crash mid-save leaves the previous checkpoint valid;
- `checkpoint.prev.json`: the previous index, kept with its files until a newer one is complete.
Every file is fsynced before the index switch and the folder after it; only then are files that
neither index names deleted. Loading verifies every sha256; when the newest checkpoint is missing
a file or corrupt, a warning names the file and the previous one is loaded. With no valid one
left, the newest's problem is a `UserError("corrupt checkpoint: PATH (...)")`.
Never pickle. Must not import asyncio, socket or threading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from gwtf.errors import UserError

__all__ = ["INDEX_NAME", "Checkpoint", "has_checkpoint", "load_checkpoint", "read_meta", "save_checkpoint"]

INDEX_NAME = "checkpoint.json"
PREV_INDEX_NAME = "checkpoint.prev.json"
FORMAT = 1
log = logging.getLogger("gwtf.checkpoint")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: completed iterations, per-stage tensors, run-wide tensors, metadata."""

    iteration: int
    stages: list[dict[str, Tensor]]
    extra: dict[str, Tensor]
    meta: dict[str, Any]


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_path(path: Path) -> None:
    """fsync a file, or a folder (its renames and unlinks; skipped where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(tensors: dict[str, Tensor], path: Path) -> str:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    _fsync_path(tmp)
    os.replace(tmp, path)
    return _sha256(path)


def _write_text_durable(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    _fsync_path(tmp)
    os.replace(tmp, path)


def save_checkpoint(
    ckpt_dir: str | Path,
    iteration: int,
    stages: list[dict[str, Tensor]],
    extra: dict[str, Tensor],
    meta: dict[str, Any],
) -> Path:
    """Write a checkpoint after `iteration` completed iterations; returns the index path."""
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for k, tensors in enumerate(stages):
        name = f"stage{k}-it{iteration:08d}.safetensors"
        files[name] = _save_tensors(tensors, root / name)
    extra_name = f"extra-it{iteration:08d}.safetensors"
    files[extra_name] = _save_tensors(extra, root / extra_name)
    index = {
        "format": FORMAT,
        "iteration": iteration,
        "stages": [f"stage{k}-it{iteration:08d}.safetensors" for k in range(len(stages))],
        "extra": extra_name,
        "sha256": files,
        "meta": meta,
    }
    index_path = root / INDEX_NAME
    keep = set(files)
    previous = _valid_index(root / INDEX_NAME, iteration)
    if previous is not None:  # the newest complete checkpoint so far becomes the fall-back
        _write_text_durable(root / PREV_INDEX_NAME, previous[0])
    else:  # (no valid newest: the fall-back stays what it was)
        previous = _valid_index(root / PREV_INDEX_NAME, iteration)
    if previous is not None:
        keep |= previous[1]
    _write_text_durable(index_path, json.dumps(index, indent=1, sort_keys=True))
    _fsync_path(root)
    for old in root.glob("*.safetensors"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    _fsync_path(root)
    return index_path


def _valid_index(path: Path, iteration: int) -> tuple[str, set[str]] | None:
    """An index's text and file names, if it parses and is of another iteration than `iteration`."""
    try:
        text = path.read_text(encoding="utf-8")
        index = _parse_index(path, text)
    except (OSError, UserError, UnicodeDecodeError):
        return None
    if index["iteration"] == iteration:
        return None
    return text, {str(name) for name in index["sha256"]}


def has_checkpoint(ckpt_dir: str | Path) -> bool:
    root = Path(ckpt_dir)
    return (root / INDEX_NAME).is_file() or (root / PREV_INDEX_NAME).is_file()


def _corrupt(path: Path, why: str) -> UserError:
    return UserError(f"corrupt checkpoint: {path} ({why})")


def _read_index(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise _corrupt(path, "index missing")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _corrupt(path, f"unreadable index: {type(exc).__name__}") from None
    return _parse_index(path, text)


def _parse_index(path: Path, text: str) -> dict[str, Any]:
    try:
        index = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _corrupt(path, f"unreadable index: {type(exc).__name__}") from None
    ok = (
        isinstance(index, dict)
        and index.get("format") == FORMAT
        and isinstance(index.get("iteration"), int)
        and isinstance(index.get("stages"), list)
        and isinstance(index.get("sha256"), dict)
        and isinstance(index.get("meta"), dict)
    )
    if not ok:
        raise _corrupt(path, "index has missing or wrong fields")
    return index


def _load_tensors(root: Path, name: Any, sha: dict[str, Any]) -> dict[str, Tensor]:
    if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
        raise _corrupt(root / INDEX_NAME, f"bad file name {name!r}")
    path = root / name
    if not path.is_file():
        raise _corrupt(path, "file missing")
    if _sha256(path) != sha.get(name):
        raise _corrupt(path, "sha256 mismatch: truncated or modified")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _corrupt(path, f"not a safetensors file: {exc}") from None


def load_checkpoint(ckpt_dir: str | Path, warn: Callable[[str], None] | None = None) -> Checkpoint:
    """Read and verify the newest checkpoint in `ckpt_dir`, else the previous one (`warn`, by
    default a logged warning, names what was wrong with the newest). UserError if there is none
    or none is valid (the newest's problem)."""
    root = Path(ckpt_dir)
    if not has_checkpoint(root):
        raise UserError(f"no checkpoint to resume from: {root / INDEX_NAME} does not exist")
    try:
        return _load_index(root, root / INDEX_NAME)
    except UserError as newest:
        if not (root / PREV_INDEX_NAME).is_file():
            raise
        (warn or (lambda text: log.warning("%s", text)))(f"{newest}; loading the previous checkpoint instead")
        try:
            return _load_index(root, root / PREV_INDEX_NAME)
        except UserError:
            raise newest from None


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """The metadata of the newest index that parses (else the previous one), without reading or
    verifying a tensor file: what a checkpoint holds, cheaply (`load_checkpoint` verifies)."""
    root = Path(ckpt_dir)
    if not has_checkpoint(root):
        raise UserError(f"no checkpoint: {root / INDEX_NAME} does not exist")
    try:
        return dict(_read_index(root / INDEX_NAME)["meta"])
    except UserError:
        if not (root / PREV_INDEX_NAME).is_file():
            raise
        return dict(_read_index(root / PREV_INDEX_NAME)["meta"])


def _load_index(root: Path, index_path: Path) -> Checkpoint:
    index = _read_index(index_path)
    sha: dict[str, Any] = index["sha256"]
    stages = [_load_tensors(root, name, sha) for name in index["stages"]]
    extra = _load_tensors(root, index.get("extra"), sha)
    return Checkpoint(iteration=index["iteration"], stages=stages, extra=extra, meta=index["meta"])
