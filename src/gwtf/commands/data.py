"""`gwtf data prepare shakespeare|synthetic|PATH` and `gwtf data info`: build the data caches.

Owns: the command's flags. Preparing = fetching the corpus if needed, training/loading the
tokenizer and tokenizing, exactly as training would on first use (`gwtf.model.data`).
"""

from __future__ import annotations

import argparse
import dataclasses

from gwtf.cli import add_config_arguments
from gwtf.config import Config, load_config

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["prepare", "info"], help="prepare: fetch + tokenize; info: print stats")
    parser.add_argument(
        "source", nargs="?", help="shakespeare, synthetic or a text file/folder (default: data.source)"
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg: Config = load_config(args.config, args.overrides)
    data = dataclasses.replace(cfg.data, source=args.source) if args.source else cfg.data
    from gwtf.model.data import load_dataset, resolve_cache_dir  # torch import only when needed

    ds = load_dataset(data, cfg.model, cfg.train.seed, cfg.train.data_holders)
    print(
        f"data {ds.name}: {len(ds.train)} train + {len(ds.val)} val tokens, vocab {ds.vocab_size} "
        f"({data.tokenizer}), unigram entropy {ds.unigram_entropy_nats():.4f} nats "
        f"({ds.unigram_entropy_bits():.4f} bits); cache {resolve_cache_dir(data)}"
    )
    return 0
