"""Finding and loading a trained model for `gwtf generate` and `gwtf export` (not a command).

Owns what `--checkpoint PATH` may name, how each checkpoint layout is read into one monolithic
`Transformer`, and where the run's config and tokenizer are found (docs/export.md):
- `gwtf train --local`: DIR, DIR/checkpoint or its checkpoint.json (`gwtf.model.checkpoint`: an
  index + one safetensors file per stage, weights as `param.<stage-local name>`, verified and
  with fall-back to the previous index); the config is the index's metadata.
- a swarm (`gwtf swarm`, `gwtf demo`, `gwtf node`): DIR, DIR/checkpoints, DIR/nodes/<name>, or one
  stage file DIR/checkpoints/stage<k>/v<N>.safetensors (`gwtf.runtime.checkpoints`: per-stage
  blobs, weights as `w.<stage-local name>`). Every stage must come from the same version: the
  newest complete one, `--version N`, or N of the file named. Each stage is looked for in
  DIR/checkpoints, then in every DIR/nodes/*/checkpoints (per-node folders). A blob without its
  manifest (runs from before manifests existed) is read unverified. The config is the run's
  config.resolved.toml (DIR, or a folder above the path), else `--config FILE`.
Optimizer state is skipped. Only the model and data sections of a config are read (keys they do
not know, from other gwtf versions, are ignored). Tokenizer: byte needs nothing; bpe is the file
the run trained into its cache (data.cache_dir, else $GWTF_CACHE, else ~/.cache/gwtf), keyed by
the corpus hash; a path is that tokenizer.json / folder (an imported model's: DIR/tokenizer, also
found there when the folder was moved); `--tokenizer FILE` names one explicitly. Every problem
is one UserError line.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gwtf.config import DataConfig, ModelConfig, from_dict, read_toml
from gwtf.errors import UserError
from gwtf.model.partition import partition_layers
from gwtf.model.presets import ModelSpec, model_spec
from gwtf.model.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    is_tokenizer_path,
    load_tokenizer_file,
)
from gwtf.runtime import checkpoints

if TYPE_CHECKING:
    from torch import Tensor

    from gwtf.model.transformer import Transformer

__all__ = ["Trained", "load_trained"]

Say = Callable[[str], None]
RESOLVED = "config.resolved.toml"
LOCAL_INDEXES = ("checkpoint.json", "checkpoint.prev.json")  # gwtf.model.checkpoint's index names
_STAGE_FILE = re.compile(r"v(\d+)\.safetensors")


def _say_stderr(text: str) -> None:
    sys.stderr.write(f"gwtf: {text}\n")


@dataclass(frozen=True, slots=True)
class Trained:
    """A trained model ready for inference, with what produced it."""

    model: Transformer
    tokenizer: Tokenizer
    model_cfg: ModelConfig
    data_cfg: DataConfig
    kind: str  # "local" | "swarm"
    version: int  # completed iterations of the checkpoint


@dataclass(frozen=True, slots=True)
class _Located:
    kind: str  # "local" | "swarm"
    folder: Path  # local: the checkpoint folder; swarm: the run folder the roots belong to
    roots: tuple[Path, ...]  # swarm: checkpoints folders, searched in order
    version: int | None  # a version named by the path itself


def _swarm_roots(run: Path) -> tuple[Path, ...]:
    own = [run / checkpoints.CHECKPOINTS_DIR] if (run / checkpoints.CHECKPOINTS_DIR).is_dir() else []
    nodes = sorted(p for p in (run / "nodes").glob(f"*/{checkpoints.CHECKPOINTS_DIR}") if p.is_dir())
    return tuple(own + nodes)


def _has_local(folder: Path) -> bool:
    return any((folder / name).is_file() for name in LOCAL_INDEXES)


def _locate(path: Path) -> _Located:
    """What kind of checkpoint `path` names (UserError when none)."""
    if not path.exists():
        raise UserError(f"checkpoint path does not exist: {path}")
    if path.is_file():
        if path.name in LOCAL_INDEXES:
            return _Located("local", path.parent, (), None)
        match = _STAGE_FILE.fullmatch(path.name)
        if match and path.parent.name.startswith("stage") and path.parent.name[5:].isdigit():
            root = path.parent.parent
            return _Located("swarm", root.parent, (root,), int(match.group(1)))
    elif _has_local(path):
        return _Located("local", path, (), None)
    elif _has_local(path / "checkpoint"):
        return _Located("local", path / "checkpoint", (), None)
    elif (path / "stage0").is_dir():
        return _Located("swarm", path.parent, (path,), None)
    elif roots := _swarm_roots(path):
        return _Located("swarm", path, roots, None)
    raise UserError(
        f"not a checkpoint: {path} (expected a `gwtf train --local` run folder with checkpoint/, or a "
        f"swarm run folder with checkpoints/stage<k>/)"
    )


def _sections(raw: dict[str, Any], where: str) -> tuple[ModelConfig, DataConfig]:
    out: list[Any] = []
    for name, cls in (("model", ModelConfig), ("data", DataConfig)):
        data = raw.get(name, {})
        if not isinstance(data, dict):
            raise UserError(f"config of the checkpoint ({where}): [{name}] is not a table")
        known = {f.name for f in dataclasses.fields(cls)}
        out.append(from_dict(cls, {k: v for k, v in data.items() if k in known}, prefix=name))
    return out[0], out[1]


def _run_config(start: Path, explicit: str | None) -> tuple[ModelConfig, DataConfig]:
    """`--config FILE`, else the nearest config.resolved.toml at `start` or above it (3 levels)."""
    if explicit:
        return _sections(read_toml(explicit), explicit)
    for folder in [start, *start.parents][:4]:
        if (folder / RESOLVED).is_file():
            try:
                raw = tomllib.loads((folder / RESOLVED).read_text(encoding="utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"config of the checkpoint is not valid TOML: {folder / RESOLVED} ({exc})") from None
            return _sections(raw, str(folder / RESOLVED))
    raise UserError(f"no {RESOLVED} in {start} or above it: pass the run's config with --config FILE")


def _global_name(local: str, stage: int, blocks: range) -> str:
    """A stage-local parameter name as the monolithic model names it (`gwtf.model.stage`)."""
    if stage == 0:
        return local
    head, j, rest = local.split(".", 2)
    return f"{head}.{blocks.start + int(j)}.{rest}"


def _assemble(spec: ModelSpec, stages: list[dict[str, Tensor]], where: str) -> Transformer:
    """One `Transformer` from per-stage weight dicts keyed by stage-local names."""
    import torch

    from gwtf.model.transformer import Transformer

    ranges = partition_layers(spec.n_layer, len(stages))
    state = {_global_name(k, s, ranges[s]): v for s, tensors in enumerate(stages) for k, v in tensors.items()}
    with torch.device("meta"):
        model = Transformer(spec)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # torch: "Error(s) in loading state_dict ...:\n\t<first problem>..."
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"checkpoint {where} does not match its config's model: {lines[min(1, len(lines) - 1)][:200]}") from None
    return model.float().eval()


def _load_local(folder: Path, version: int | None, say: Say) -> tuple[dict[str, Any], list[dict[str, Tensor]], int]:
    from gwtf.model.checkpoint import load_checkpoint

    ckpt = load_checkpoint(folder, warn=say)
    if version is not None and version != ckpt.iteration:
        raise UserError(f"--version {version}: {folder} holds the checkpoint after iteration {ckpt.iteration}")
    config = ckpt.meta.get("config")
    if not isinstance(config, dict):
        raise UserError(f"corrupt checkpoint: {folder} (config missing from its index)")
    weights = [{k[len("param."):]: v for k, v in t.items() if k.startswith("param.")} for t in ckpt.stages]
    return config, weights, ckpt.iteration


def _read_stage(roots: tuple[Path, ...], stage: int, version: int) -> dict[str, Tensor] | str:
    """Weights of `stage` at `version` from the first root holding a good copy, else the problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    problems: list[str] = []
    for root in roots:
        blob_path = checkpoints.stage_dir(root, stage) / f"v{version}.safetensors"
        if not blob_path.is_file():
            continue
        try:
            if blob_path.with_suffix(".json").is_file():
                blob = checkpoints.read_version(root, stage, version)
            else:  # written before manifests existed: safetensors' own header check only
                blob = blob_path.read_bytes()
            tensors = st_load(blob)
        except (checkpoints.CheckpointError, SafetensorError, OSError, ValueError) as exc:
            problems.append(str(exc) if isinstance(exc, checkpoints.CheckpointError) else f"{blob_path}: {exc}")
            continue
        return {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
    return "; ".join(problems) or f"stage {stage} has no version {version} in {', '.join(map(str, roots))}"


def _load_swarm(roots: tuple[Path, ...], stages: int, version: int | None, say: Say) -> tuple[list[dict[str, Tensor]], int]:
    """Every stage at `version`, else at the newest version complete for all stages (versions
    skipped on the way are reported to `say`, naming the bad file)."""
    found = {v for root in roots for k in range(stages) for v in checkpoints.versions(root, k) if v > 0}
    skipped: list[str] = []
    for v in [version] if version is not None else sorted(found, reverse=True):
        read = [_read_stage(roots, k, v) for k in range(stages)]
        problems = [r for r in read if isinstance(r, str)]
        if not problems:
            for text in skipped:
                say(text)
            return [r for r in read if not isinstance(r, str)], v
        if version is not None:
            raise UserError(f"checkpoint version {v} is not usable: {problems[0]}")
        skipped.append(f"checkpoint version {v} skipped: {problems[0]}")
    why = f" (newest: {skipped[0]})" if skipped else ""
    raise UserError(f"no checkpoint complete for all {stages} stages in {', '.join(map(str, roots))}{why}")


def _corpus_sha(data_cfg: DataConfig, folder: Path) -> str | None:
    """The hash of the corpus `folder` caches, if it can be read without a download."""
    from gwtf.model.data import Corpus, load_corpus, read_shakespeare_cache

    if folder.name == "shakespeare":
        docs = read_shakespeare_cache(folder)
        return None if docs is None else Corpus("shakespeare", docs, folder).sha256
    try:
        cfg = data_cfg if folder.name != "synthetic" else dataclasses.replace(data_cfg, source="synthetic")
        return load_corpus(cfg).sha256
    except UserError:  # e.g. the run's data file is gone: fall back to what the cache holds
        return None


def find_tokenizer(data_cfg: DataConfig, explicit: str | None, say: Say = _say_stderr,
                   near: Path | None = None) -> Tokenizer:
    """The run's tokenizer: byte, `--tokenizer FILE`, the file data.tokenizer names (else the
    tokenizer/ folder of an imported model beside the checkpoint `near`, when it was moved), or the
    BPE file in the run's cache (the one of the corpus' hash; else the only one of the vocabulary
    size there)."""
    from gwtf.model.data import resolve_cache_dir

    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    if is_tokenizer_path(data_cfg.tokenizer):
        return load_tokenizer_file(explicit or _recorded_tokenizer(data_cfg.tokenizer, near))
    if explicit:
        if Path(explicit).is_dir():
            return load_tokenizer_file(explicit)
        return _bpe_file(Path(explicit), data_cfg.vocab_size)
    cache = resolve_cache_dir(data_cfg)
    folders = {"shakespeare": [cache / "shakespeare", cache / "synthetic"], "synthetic": [cache / "synthetic"]}
    pattern = f"tokenizer-bpe-v{data_cfg.vocab_size}-*.json"
    for folder in folders.get(data_cfg.source, [cache / "files"]):
        candidates = sorted(folder.glob(pattern))
        sha = _corpus_sha(data_cfg, folder) if candidates else None
        exact = [p for p in candidates if sha is not None and p.name == pattern.replace("*", sha[:16])]
        if exact or len(candidates) == 1:
            chosen = (exact or candidates)[0]
            if folder.name == "synthetic" and data_cfg.source == "shakespeare":
                say(f"tokenizer: Shakespeare is not cached; using {chosen} (the offline fallback corpus)")
            return _bpe_file(chosen, data_cfg.vocab_size)
        if candidates:
            raise UserError(f"tokenizer: {len(candidates)} files match {folder / pattern}; name the run's "
                            f"with --tokenizer FILE")
    raise UserError(f"tokenizer not found: no {pattern} in {cache} (data.cache_dir / $GWTF_CACHE of the run); "
                    f"pass --tokenizer FILE")


def _recorded_tokenizer(recorded: str, near: Path | None) -> Path:
    """The tokenizer path a config records, else (moved) the tokenizer/ folder next to `near`."""
    from gwtf.model.hf_import import TOKENIZER_DIR

    path = Path(recorded).expanduser()
    if path.exists() or near is None:
        return path
    return next((f / TOKENIZER_DIR for f in (near, near.parent) if (f / TOKENIZER_DIR).is_dir()), path)


def _bpe_file(path: Path, vocab_size: int) -> Tokenizer:
    if not path.is_file():
        raise UserError(f"tokenizer file not found: {path}")
    try:
        return BpeTokenizer.from_file(path, vocab_size)
    except Exception as exc:  # tokenizers raises its own exception types for unreadable JSON
        raise UserError(f"not a gwtf BPE tokenizer of vocabulary {vocab_size}: {path} ({exc})") from None


def load_trained(
    path: str | Path, *, version: int | None = None, config: str | None = None, tokenizer: str | None = None,
    say: Say = _say_stderr,
) -> Trained:
    """The model, tokenizer and config of the checkpoint `path` names (module docstring). The
    cheap checks (path, config, tokenizer) come before reading any weights where they can."""
    where = _locate(Path(path))
    if where.kind == "local":
        raw, stages, done = _load_local(where.folder, version, say)
        model_cfg, data_cfg = _run_config(where.folder, config) if config else _sections(raw, str(where.folder))
        tok = find_tokenizer(data_cfg, tokenizer, say, where.folder)
    else:
        model_cfg, data_cfg = _run_config(where.folder, config)
        tok = find_tokenizer(data_cfg, tokenizer, say, where.folder)
        want = where.version if version is None else version
        stages, done = _load_swarm(where.roots, model_cfg.stages, want, say)
    model = _assemble(model_spec(model_cfg, tok.vocab_size), stages, str(path))
    return Trained(model=model, tokenizer=tok, model_cfg=model_cfg, data_cfg=data_cfg, kind=where.kind, version=done)
