"""`model.init_from`: what it may name, what it gives a run's config, and its weights.

Owns: telling the two kinds of source apart (`open_source`): a gwtf checkpoint (a `gwtf train
--local` or `gwtf import` folder, `gwtf.model.checkpoint`'s layout) or a Hugging Face GPT-2 /
Llama folder (`gwtf.model.hf_import`); `resolve_init(cfg)`, the config with the source's shape
keys and tokenizer filled in; and `load_initial_weights`, the hook `gwtf.model.stage.build_stage`
calls when the spec names a source, so that every place a stage is built (local trainer, swarm
worker, validation, tensor simulator) starts from the same weights.

Rules of `resolve_init` (docs/models.md):
- The shape keys (`SHAPE_KEYS`) come from the source; one set to a value other than both its
  default and the source's is a UserError naming it, and so is a preset other than the default;
  the result has preset "custom" and every shape key set, so resolving again changes nothing.
- model.seq_len left at its default is lowered to the model's positions when it has fewer.
- data.tokenizer left at "bpe" becomes the source's tokenizer: an HF folder's tokenizer.json (the
  folder), or the checkpoint's recorded one (a path, moved along with the run folder's
  tokenizer/, or "byte"; a "bpe" one only when data.source is the corpus it was trained on).
- model.init_from becomes an absolute path (nodes may start elsewhere).
Only the weights come from the source: the optimizer starts fresh, the iteration count at 0.
Must not import asyncio, socket, threading, or anything from gwtf.runtime / gwtf.protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gwtf.config import Config, DataConfig, ModelConfig, from_dict
from gwtf.errors import UserError
from gwtf.model.checkpoint import INDEX_NAME, load_checkpoint, read_meta
from gwtf.model.hf_import import TOKENIZER_DIR, hf_tensors, is_hf_folder, open_hf_folder, shape_of_spec
from gwtf.model.partition import partition_layers
from gwtf.model.presets import ModelSpec, model_spec
from gwtf.model.tokenizer import is_tokenizer_path, vocab_size_for

__all__ = ["SHAPE_KEYS", "InitSource", "initial_state", "load_initial_weights", "open_source", "resolve_init"]

SHAPE_KEYS = ("family", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "max_positions",
              "rope_theta", "norm_eps")
_PREV_INDEX = "checkpoint.prev.json"


@dataclass(frozen=True, slots=True)
class InitSource:
    """An opened `model.init_from` source."""

    kind: str  # "hf" | "gwtf"
    path: Path  # the HF folder, or the gwtf checkpoint folder (holding checkpoint.json)
    shape: dict[str, Any]  # SHAPE_KEYS -> the model's values
    tokenizer: str | None  # the data.tokenizer it brings; None: it has none
    data: DataConfig | None  # gwtf: the checkpoint's [data]


def _gwtf_folder(path: Path) -> Path | None:
    """The checkpoint folder `path` names (the folder, its run folder, or an index file)."""
    if path.is_file() and path.name in (INDEX_NAME, _PREV_INDEX):
        return path.parent
    for folder in (path, path / "checkpoint"):
        if (folder / INDEX_NAME).is_file() or (folder / _PREV_INDEX).is_file():
            return folder
    return None


def _sections(meta: dict[str, Any], where: Path) -> tuple[ModelConfig, DataConfig]:
    raw = meta.get("config")
    if not isinstance(raw, dict):
        raise UserError(f"corrupt checkpoint: {where} (config missing from its index)")
    out: list[Any] = []
    for name, cls in (("model", ModelConfig), ("data", DataConfig)):
        section = raw.get(name, {})
        known = {f.name for f in dataclasses.fields(cls)}
        out.append(from_dict(cls, {k: v for k, v in section.items() if k in known} if isinstance(section, dict)
                             else {}, prefix=name))
    return out[0], out[1]


def _recorded_tokenizer(data: DataConfig, folder: Path) -> str | None:
    """The checkpoint's tokenizer as a data.tokenizer value, following a moved run folder (None:
    its file is gone, e.g. an import of a folder without tokenizer.json)."""
    if not is_tokenizer_path(data.tokenizer) or Path(data.tokenizer).expanduser().exists():
        return data.tokenizer
    for run in (folder, folder.parent):
        if (run / TOKENIZER_DIR / "tokenizer.json").is_file():
            return str((run / TOKENIZER_DIR).absolute())
    return None


def open_source(path: str | Path) -> InitSource:
    """What `path` is and what it holds (no tensor is read). UserError (one line) otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"model.init_from {p}: no such file or folder")
    if is_hf_folder(p):
        hf = open_hf_folder(p)
        tok = str(p.absolute()) if (p / "tokenizer.json").is_file() else None
        return InitSource("hf", p.absolute(), dict(hf.shape), tok, None)
    folder = _gwtf_folder(p)
    if folder is None:
        hint = " (a swarm run: `gwtf export` it and start from the export)" if (p / "checkpoints").is_dir() else ""
        raise UserError(f"model.init_from {p}: not a gwtf checkpoint (a `gwtf train --local` or `gwtf import` "
                        f"folder) nor a Hugging Face folder (config.json + safetensors){hint}")
    model_cfg, data_cfg = _sections(read_meta(folder), folder)
    tok = _recorded_tokenizer(data_cfg, folder)
    data_cfg = dataclasses.replace(data_cfg, tokenizer=tok or data_cfg.tokenizer)
    vocab = model_cfg.vocab_size or vocab_size_for(data_cfg)
    spec = model_spec(dataclasses.replace(model_cfg, init_from=""), vocab)
    return InitSource("gwtf", folder.absolute(), shape_of_spec(spec), tok, data_cfg)


def _conflict(key: str, mine: Any, theirs: Any, where: Path) -> UserError:
    return UserError(f"model.{key} = {mine!r} conflicts with model.init_from {where} ({key} = {theirs!r}): "
                     f"remove the key, the model's shape comes from init_from")


def _resolve_model(m: ModelConfig, src: InitSource) -> ModelConfig:
    defaults = ModelConfig()
    for key in SHAPE_KEYS:
        mine, theirs = getattr(m, key), src.shape[key]
        if mine != getattr(defaults, key) and mine != theirs:
            raise _conflict(key, mine, theirs, src.path)
    if m.preset not in (defaults.preset, "custom"):
        raise _conflict("preset", m.preset, "custom", src.path)
    positions = int(src.shape["max_positions"])
    seq_len = m.seq_len
    if seq_len > positions:
        if seq_len != defaults.seq_len:
            raise UserError(f"model.seq_len = {seq_len} exceeds the {positions} positions of model.init_from "
                            f"{src.path}")
        seq_len = positions
    return dataclasses.replace(m, preset="custom", seq_len=seq_len, init_from=str(src.path), **src.shape)


def _resolve_data(d: DataConfig, src: InitSource) -> DataConfig:
    if d.tokenizer != DataConfig().tokenizer:
        return d  # the user's choice (model_spec checks that it fits the embedding)
    if src.tokenizer is None:
        raise UserError(f"model.init_from {src.path} has no tokenizer (no tokenizer.json): set data.tokenizer "
                        f"(a tokenizer.json, a folder holding one, or \"byte\")")
    if src.tokenizer != "bpe":
        return dataclasses.replace(d, tokenizer=src.tokenizer)
    assert src.data is not None
    if d.source != src.data.source:
        raise UserError(f"model.init_from {src.path}: its BPE tokenizer was trained on data.source = "
                        f"{src.data.source!r}; to train on {d.source!r} set data.tokenizer to that tokenizer's "
                        f"file (tokenizer-bpe-*.json in the run's cache)")
    if d.vocab_size not in (DataConfig().vocab_size, src.data.vocab_size):
        raise UserError(f"data.vocab_size = {d.vocab_size} conflicts with model.init_from {src.path} "
                        f"(vocab_size = {src.data.vocab_size})")
    return dataclasses.replace(d, vocab_size=src.data.vocab_size)


def resolve_init(cfg: Config) -> Config:
    """`cfg` with model.init_from's shape and tokenizer filled in (module docstring); `cfg` itself
    when init_from is empty. Idempotent."""
    if not cfg.model.init_from:
        return cfg
    src = open_source(cfg.model.init_from)
    return dataclasses.replace(cfg, model=_resolve_model(cfg.model, src), data=_resolve_data(cfg.data, src))


def _check_shape(src: InitSource, spec: ModelSpec) -> None:
    want = shape_of_spec(spec)
    for key in SHAPE_KEYS:
        if src.shape[key] != want[key]:
            raise UserError(f"model.init_from {src.path}: its {key} is {src.shape[key]!r}, the model being built "
                            f"has {want[key]!r} (the config was not resolved with its init_from)")


def _gwtf_state(folder: Path, n_layer: int) -> dict[str, Tensor]:
    ckpt = load_checkpoint(folder)
    ranges = partition_layers(n_layer, len(ckpt.stages))
    out: dict[str, Tensor] = {}
    for k, tensors in enumerate(ckpt.stages):
        for key, t in tensors.items():
            if not key.startswith("param."):
                continue
            local = key[len("param."):]
            if k > 0:
                head, j, rest = local.split(".", 2)
                local = f"{head}.{ranges[k].start + int(j)}.{rest}"
            out[local] = t
    return out


def initial_state(spec: ModelSpec, names: Iterable[str]) -> dict[str, Tensor]:
    """The parameters `names` (monolithic names) of the source `spec.init_from`, float32 on the CPU."""
    src = open_source(spec.init_from)
    _check_shape(src, spec)
    wanted = list(names)
    if src.kind == "hf":
        return hf_tensors(open_hf_folder(src.path), wanted)
    state = _gwtf_state(src.path, spec.n_layer)
    missing = [n for n in wanted if n not in state]
    if missing:
        raise UserError(f"corrupt checkpoint: {src.path} (parameter {missing[0]} missing)")
    return {n: state[n].to(torch.float32) for n in wanted}


@torch.no_grad()
def load_initial_weights(module: nn.Module, spec: ModelSpec, global_name: Callable[[str], str]) -> None:
    """Overwrite every parameter of `module` (a stage or a whole model) with the source's;
    `global_name` maps a local parameter name to the monolithic one."""
    local_names = [n for n, _ in module.named_parameters()]
    state = initial_state(spec, [global_name(n) for n in local_names])
    for local, p in module.named_parameters():
        t = state[global_name(local)]
        if tuple(t.shape) != tuple(p.shape):
            raise UserError(f"model.init_from {spec.init_from}: {global_name(local)} has shape {list(t.shape)}, "
                            f"the model {list(p.shape)}")
        p.copy_(t)
