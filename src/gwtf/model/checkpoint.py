"""Checkpoints: one safetensors file per stage plus a JSON index, written atomically.

Owns: the on-disk layout of `DIR/checkpoint/`:
- `stage<k>-it<t>.safetensors`: everything stage k needs to continue (weights and optimizer
  state, as flat named tensors; the trainer chooses the names);
- `extra-it<t>.safetensors`: run-wide tensors (RNG state);
- `checkpoint.json`: the index (format, iteration, file names with sha256, plus the trainer's
  JSON metadata). It is replaced last with `os.replace`, so it always points at a complete set
  of files: a crash mid-save leaves the previous checkpoint valid. Files it no longer names are
  deleted after the switch.
Any unreadable, truncated or mismatching file is a `UserError("corrupt checkpoint: PATH (...)")`.
Never pickle. Must not import asyncio, socket or threading.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from gwtf.errors import UserError

__all__ = ["INDEX_NAME", "Checkpoint", "has_checkpoint", "load_checkpoint", "save_checkpoint"]

INDEX_NAME = "checkpoint.json"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: completed iterations, per-stage tensors, run-wide tensors, metadata."""

    iteration: int
    stages: list[dict[str, Tensor]]
    extra: dict[str, Tensor]
    meta: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save_tensors(tensors: dict[str, Tensor], path: Path) -> str:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    return _sha256(path)


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
    tmp = index_path.with_name(INDEX_NAME + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, index_path)
    for old in root.glob("*.safetensors"):
        if old.name not in files:
            old.unlink(missing_ok=True)
    return index_path


def has_checkpoint(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / INDEX_NAME).is_file()


def _corrupt(path: Path, why: str) -> UserError:
    return UserError(f"corrupt checkpoint: {path} ({why})")


def _read_index(root: Path) -> dict[str, Any]:
    path = root / INDEX_NAME
    if not path.is_file():
        raise UserError(f"no checkpoint to resume from: {path} does not exist")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
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


def load_checkpoint(ckpt_dir: str | Path) -> Checkpoint:
    """Read and verify the checkpoint in `ckpt_dir` (UserError if absent or corrupt)."""
    root = Path(ckpt_dir)
    index = _read_index(root)
    sha: dict[str, Any] = index["sha256"]
    stages = [_load_tensors(root, name, sha) for name in index["stages"]]
    extra = _load_tensors(root, index.get("extra"), sha)
    return Checkpoint(iteration=index["iteration"], stages=stages, extra=extra, meta=index["meta"])
