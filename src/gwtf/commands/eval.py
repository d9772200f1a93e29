"""`gwtf eval`: held-out loss and perplexity of a checkpoint, e.g. to check an import before training.

Owns the command's flags (--checkpoint and the flags completing it, shared with `gwtf generate`;
--data; --json; --set for the [data] / [train] / [model] keys that choose the held-out windows;
--device) and the report. What is evaluated is exactly what `gwtf train --local` reports: the
run's validation split (data.val_fraction at the end of the corpus), `train.eval_microbatches`
fixed microbatches of `model.microbatch_size` x `model.seq_len` tokens, the mean of their mean
next-token losses (`gwtf.model.trainer.evaluate`). So the loss of an imported model equals the
`val_loss_start` of a `gwtf train --local` run started from it on the same data and config.
--checkpoint also takes a Hugging Face folder (evaluated as `model.init_from` would load it).
Loading is `gwtf.commands.trained`; the data comes from the checkpoint's [data] section, with
data.source replaced by --data; the tokenizer is always the checkpoint's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gwtf.cli import add_device_argument, device_overrides
from gwtf.commands.generate import add_source_arguments
from gwtf.config import Config, from_dict, merge_overrides, to_dict
from gwtf.errors import UserError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--data", metavar="PATH",
                        help="corpus whose held-out split is evaluated (data.source; default: the checkpoint's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    parser.add_argument(
        "--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
        help="override a [data]/[train] key or model.seq_len/microbatch_size (repeatable), e.g. "
             "--set train.eval_microbatches=32",
    )
    add_device_argument(parser)


def _config(model: dict[str, Any], data: dict[str, Any], args: argparse.Namespace) -> Config:
    raw = merge_overrides({"model": model, "data": data}, list(args.overrides) + device_overrides(args))
    cfg = from_dict(Config, raw)
    if args.data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=args.data))
    return cfg


def _from_hf(args: argparse.Namespace) -> tuple[Config, list[nn.Module], str, int]:
    """An HF folder as `model.init_from` loads it (the stages are built from its weights)."""
    from gwtf.model.presets import model_spec
    from gwtf.model.pretrained import resolve_init
    from gwtf.model.stage import build_stage
    from gwtf.model.tokenizer import vocab_size_for

    data = {"tokenizer": args.tokenizer} if args.tokenizer else {}
    cfg = resolve_init(_config({"init_from": args.checkpoint, "stages": 2}, data, args))
    spec = model_spec(cfg.model, vocab_size_for(cfg.data))
    return cfg, [build_stage(spec, k, 2, 0) for k in range(2)], "hf", 0


def _from_checkpoint(args: argparse.Namespace, tmp: Path) -> tuple[Config, list[nn.Module], str, int]:
    from gwtf.commands.trained import load_trained
    from gwtf.model.stage import split_model
    from gwtf.model.tokenizer import BpeTokenizer

    trained = load_trained(args.checkpoint, version=args.version, config=args.config, tokenizer=args.tokenizer)
    cfg = _config(to_dict(trained.model_cfg), to_dict(trained.data_cfg), args)
    if isinstance(trained.tokenizer, BpeTokenizer) and cfg.data.source != trained.data_cfg.source:
        path = tmp / "tokenizer.json"  # the run's BPE, not one trained on the evaluated corpus
        path.write_text(trained.tokenizer.to_json(), encoding="utf-8")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(path)))
    if cfg.model.seq_len > trained.model.spec.seq_len:
        raise UserError(f"model.seq_len = {cfg.model.seq_len} exceeds the model's {trained.model.spec.seq_len} "
                        f"positions")
    return cfg, split_model(trained.model, 2), trained.kind, trained.version


def run(args: argparse.Namespace) -> int:
    from gwtf.model.hf_import import is_hf_folder

    if not Path(args.checkpoint).exists():
        raise UserError(f"checkpoint path does not exist: {args.checkpoint}")
    if args.data is not None and not Path(args.data).expanduser().exists() and args.data not in (
            "shakespeare", "synthetic"):
        raise UserError(f"--data {args.data}: no such file or folder")
    hf = is_hf_folder(args.checkpoint) and not (Path(args.checkpoint) / "checkpoint").is_dir()
    with tempfile.TemporaryDirectory(prefix="gwtf-eval-") as tmp:
        cfg, stages, kind, version = _from_hf(args) if hf else _from_checkpoint(args, Path(tmp))
        from gwtf.model.data import load_dataset, resolve_source
        from gwtf.model.device import resolve_device
        from gwtf.model.tokenizer import cache_key
        from gwtf.model.trainer import evaluate

        device = resolve_device(cfg.train.device, "--device" if args.device else "train.device =")
        data = resolve_source(cfg.data)
        dataset = load_dataset(data, cfg.model, cfg.train.seed, 1, microbatches=cfg.train.microbatches)
        batches = dataset.val_microbatches(cfg.train.eval_microbatches)
        if not batches:
            raise UserError(f"no held-out windows to evaluate: {len(dataset.val)} validation tokens of {dataset.name} "
                            f"(data.val_fraction = {data.val_fraction}, model.seq_len = {cfg.model.seq_len})")
        loss = evaluate([s.to(device) for s in stages], batches, cfg.train.precision)
        key = cache_key(data)
    assert loss is not None
    tokens = sum(int(y.numel()) for _, y in batches)
    report = {
        "checkpoint": str(args.checkpoint), "kind": kind, "version": version, "data": dataset.name,
        "tokenizer": key, "loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens,
        "microbatches": len(batches), "microbatch_size": cfg.model.microbatch_size, "seq_len": cfg.model.seq_len,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"eval: loss {loss:.4f}, perplexity {report['perplexity']:.2f} on {tokens} held-out tokens "
              f"({len(batches)} microbatches of {cfg.model.microbatch_size} x {cfg.model.seq_len}) of {dataset.name}; "
              f"{kind} checkpoint {args.checkpoint} (version {version})")
    return 0
