"""The swarm's stage checkpoints on disk: hashed, fsynced, two versions kept, verified on load.

Owns the layout of `DIR/checkpoints/stage<k>/` (one folder per stage; on one machine every node
of a local swarm shares it, across machines each host keeps its own, and a data holder's holds
copies of every relay stage's, `protocol.checkpoint_replicate`):
- `v<version>.safetensors`: the stage's state blob (weights + AdamW state, `StageWorker.state_blob`);
- `v<version>.json`: its manifest `{"format", "stage", "version", "bytes", "sha256"}`.
A version of a stage is *complete* when both files exist and the blob's size and sha256 match the
manifest. Writing order (`write_version`): blob (temp file, fsync, rename), manifest (same), then
the folder is fsynced; only then are older versions deleted, and the previous complete version is
always kept, so a crash or a torn write at any moment leaves a complete older version on disk.
`newest_complete` picks the newest version complete for every stage (what `--resume` continues
from), warning about each missing, truncated or modified file it skips.

Version 0 (the seeded initial model) is never written. Torch-free (the launcher reads it); must not
import torch or asyncio.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from gwtf.errors import NothingToDo, UserError

__all__ = [
    "CHECKPOINTS_DIR", "CheckpointError", "fsync_dir", "keep_version", "newest_complete", "read_version",
    "resume_version",
    "stage_dir",
    "verify_version", "versions", "write_version",
]

CHECKPOINTS_DIR = "checkpoints"
FORMAT = 1
log = logging.getLogger("gwtf.checkpoints")
Warn = Callable[[str], None]


class CheckpointError(ValueError):
    """A stage checkpoint file is missing, truncated or modified (the message names the file)."""


def stage_dir(ckpt_dir: Path, stage: int) -> Path:
    return Path(ckpt_dir) / f"stage{stage}"


def _paths(ckpt_dir: Path, stage: int, version: int) -> tuple[Path, Path]:
    folder = stage_dir(ckpt_dir, stage)
    return folder / f"v{version}.safetensors", folder / f"v{version}.json"


def fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in `folder` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes | memoryview) -> None:
    """Temp file in the same folder, fsync, atomic rename (the folder is fsynced by the caller)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def versions(ckpt_dir: Path, stage: int) -> list[int]:
    """Versions of `stage` with a blob or a manifest on disk, newest first."""
    found: set[int] = set()
    folder = stage_dir(ckpt_dir, stage)
    if folder.is_dir():
        for p in folder.iterdir():
            stem, suffix = p.stem, p.suffix
            if suffix in (".safetensors", ".json") and stem.startswith("v") and stem[1:].isdigit():
                found.add(int(stem[1:]))
    return sorted(found, reverse=True)


def write_version(ckpt_dir: Path, stage: int, version: int, blob: bytes | memoryview) -> Path:
    """Write version `version` of `stage` durably, then delete all but it and the previous
    complete version. Returns the blob's path. Replicas writing the same version write the
    same bytes, so concurrent writers on one folder are harmless (atomic renames)."""
    data, meta = _paths(ckpt_dir, stage, version)
    data.parent.mkdir(parents=True, exist_ok=True)
    _write_durable(data, blob)
    manifest = {"format": FORMAT, "stage": stage, "version": version, "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest()}
    _write_durable(meta, json.dumps(manifest, sort_keys=True).encode())
    fsync_dir(data.parent)
    _prune(ckpt_dir, stage, version)
    return data


def keep_version(ckpt_dir: Path, stage: int, version: int, blob: bytes | memoryview) -> bool:
    """`write_version`, unless that version is already on disk with the blob's size and sha256
    (a folder shared by the nodes of one host: the replicas wrote it). True when written."""
    data, meta = _paths(ckpt_dir, stage, version)
    digest = hashlib.sha256(blob).hexdigest()
    try:
        manifest = _manifest(meta, stage, version)
        same = manifest["sha256"] == digest and data.stat().st_size == manifest["bytes"] == len(blob)
    except (OSError, CheckpointError):
        same = False
    if same:
        return False
    write_version(ckpt_dir, stage, version, blob)
    return True


def _prune(ckpt_dir: Path, stage: int, newest: int) -> None:
    older = [v for v in versions(ckpt_dir, stage) if v < newest]
    keep = next((v for v in older if _looks_complete(ckpt_dir, stage, v)), None)
    removed = False
    for v in older:
        if keep is not None and v >= keep:
            continue
        for p in _paths(ckpt_dir, stage, v):
            p.unlink(missing_ok=True)
        removed = True
    if removed:
        fsync_dir(stage_dir(ckpt_dir, stage))


def _looks_complete(ckpt_dir: Path, stage: int, version: int) -> bool:
    """Manifest readable and blob of its size: the cheap test pruning uses (no re-hash of a
    possibly large blob on every save; loading verifies the sha256)."""
    data, meta = _paths(ckpt_dir, stage, version)
    try:
        return data.stat().st_size == _manifest(meta, stage, version)["bytes"]
    except (OSError, CheckpointError):
        return False


def _manifest(meta: Path, stage: int, version: int) -> dict[str, object]:
    try:
        manifest = json.loads(meta.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{meta}: manifest missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta}: unreadable manifest ({type(exc).__name__})") from None
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("stage") == stage
          and manifest.get("version") == version and isinstance(manifest.get("bytes"), int)
          and isinstance(manifest.get("sha256"), str))
    if not ok:
        raise CheckpointError(f"{meta}: manifest has missing or wrong fields")
    return manifest


def read_version(ckpt_dir: Path, stage: int, version: int) -> bytes:
    """The verified blob of `version` of `stage` (CheckpointError naming the bad file)."""
    data, meta = _paths(ckpt_dir, stage, version)
    manifest = _manifest(meta, stage, version)
    try:
        blob = data.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{data}: file missing") from None
    except OSError as exc:
        raise CheckpointError(f"{data}: unreadable ({exc.strerror})") from None
    if len(blob) != manifest["bytes"]:
        raise CheckpointError(f"{data}: truncated ({len(blob)} of {manifest['bytes']} bytes)")
    if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
        raise CheckpointError(f"{data}: sha256 mismatch (modified or corrupt)")
    return blob


def verify_version(ckpt_dir: Path, stage: int, version: int) -> str | None:
    """None if `version` of `stage` is complete, else what is wrong (naming the file)."""
    try:
        read_version(ckpt_dir, stage, version)
    except CheckpointError as exc:
        return str(exc)
    return None


def newest_complete(ckpt_dir: Path, stages: int, warn: Warn | None = None) -> int | None:
    """The newest version (> 0) complete for all `stages`, or None. Every version newer than it
    that some stage has on disk but that is missing or corrupt somewhere is reported to `warn`
    (default: a logged warning) with the file it failed on."""
    say = warn or (lambda text: log.warning("%s", text))
    candidates = sorted({v for k in range(stages) for v in versions(ckpt_dir, k) if v > 0}, reverse=True)
    for v in candidates:
        problems = [p for k in range(stages) if (p := verify_version(ckpt_dir, k, v)) is not None]
        if not problems:
            return v
        for p in problems:
            say(f"checkpoint version {v} skipped: {p}")
    return None


def _holdings(ckpt_dir: Path, stages: int) -> str:
    """What each stage has complete, for the error that says why nothing can be resumed:
    "stage 0: v10, v5; stage 1: none"."""
    parts = []
    for k in range(stages):
        done = [v for v in sorted(versions(ckpt_dir, k), reverse=True) if v > 0 and verify_version(ckpt_dir, k, v) is None]
        parts.append(f"stage {k}: " + (", ".join(f"v{v}" for v in done) if done else "none"))
    return "; ".join(parts)


def training_ended(records: Path) -> int | None:
    """The weight version a node's records say its run ended at (its last `training_over`
    record), or None: the node never saw the run end (or the file is unreadable)."""
    ended: int | None = None
    try:
        with records.open("rb") as fh:
            for line in fh:
                if b'"training_over"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if isinstance(rec, dict) and rec.get("event") == "training_over" and isinstance(rec.get("version"), int):
                    ended = rec["version"]
    except OSError:
        return None
    return ended


def resume_version(ckpt_dir: Path, stages: int, iterations: int, every: int, warn: Warn | None = None,
                   ended: int | None = None) -> int:
    """The version `--resume` continues from: `newest_complete`, checked against the config
    (UserError: nothing to resume from, or checkpoint_every changed; NothingToDo: the run is finished).
    `ended`: the version this folder's node saw the run end at (`training_over`). A finished run
    whose final version is not complete here (a data holder's final copy of a relay stage never
    came) is a UserError naming the stages that lack it: resuming from an older version would
    wait for nodes that will never come, as the run is over."""
    version = newest_complete(ckpt_dir, stages, warn)
    if ended is not None and iterations and ended >= iterations and (version is None or version < ended):
        lacking = [k for k in range(stages) if verify_version(ckpt_dir, k, ended) is not None]
        raise UserError(f"the run finished at version {ended}, but {ckpt_dir} lacks that version of stage(s) "
                        f"{', '.join(map(str, lacking))} (its final copies never came; {_holdings(ckpt_dir, stages)}): "
                        "copy them from a node that served the stage, or run `gwtf audit` on the gathered folders")
    if version is None:
        raise UserError(f"nothing to resume from: {ckpt_dir} has no checkpoint complete for all {stages} stages "
                        f"({_holdings(ckpt_dir, stages)})")
    if iterations and version >= iterations:
        raise NothingToDo(f"the run is finished: every stage's checkpoint in {ckpt_dir} is at version {version} "
                          f"and train.iterations={iterations}; nothing to resume (raise --iterations to train on)")
    if version % every:
        raise UserError(f"cannot resume: checkpoint version {version} in {ckpt_dir} is not a multiple of "
                        f"protocol.checkpoint_every={every} (resume with the run's checkpoint_every)")
    return version
