"""`gwtf data prepare shakespeare|synthetic|PATH` and `gwtf data info`: build the data caches.

Owns: the command's flags and its progress bar. Preparing = fetching the corpus if needed,
training/loading the tokenizer (`model.init_from`'s, when set) and tokenizing, exactly as
training would on first use (`gwtf.model.data`); a path corpus is tokenized in parallel into
memory-mapped tokens (`gwtf.model.prepare`), with a progress bar on a terminal and one plain
line otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

from gwtf.cli import add_config_arguments
from gwtf.config import Config, load_config

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["prepare", "info"], help="prepare: fetch + tokenize; info: print stats")
    parser.add_argument(
        "source", nargs="?",
        help="shakespeare, synthetic, or a .txt / .jsonl / .jsonl.gz / .parquet file or a folder of them "
             "(default: data.source)",
    )
    add_config_arguments(parser)


@contextlib.contextmanager
def _progress_bar() -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr when it is a terminal, else no callback."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokenizing", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _describe(manifest: dict[str, Any], folder: str) -> str:
    from gwtf.model.prepare import malformed_summary

    files = manifest["files"]
    mb = sum(f["size"] for f in files) / 1e6
    line = (f"prepared {len(files)} files ({mb:.1f} MB): {manifest['records']} records, {manifest['tokens']} tokens "
            f"({manifest['dtype']}), reused (unchanged): {folder}")
    bad = malformed_summary(manifest)
    return f"{line}\n{bad}" if bad else line


def run(args: argparse.Namespace) -> int:
    from gwtf.model.data import is_path_source, load_dataset, prepare_corpus, resolve_cache_dir

    cfg: Config = load_config(args.config, args.overrides)
    if cfg.model.init_from:  # its tokenizer, as training will use it (imports torch: only then)
        from gwtf.model.pretrained import resolve_init

        cfg = resolve_init(cfg)
    data = dataclasses.replace(cfg.data, source=args.source) if args.source else cfg.data

    if is_path_source(data):
        with _progress_bar() as progress:
            prepared = prepare_corpus(data, progress=progress)
        if prepared.reused:  # a fresh prepare has said what it made (and what it skipped) already
            print(_describe(prepared.manifest, str(prepared.folder)))
    ds = load_dataset(data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches)
    print(
        f"data {ds.name}: {len(ds.train)} train + {len(ds.val)} val tokens, vocab {ds.vocab_size} "
        f"({data.tokenizer}), unigram entropy {ds.unigram_entropy_nats():.4f} nats "
        f"({ds.unigram_entropy_bits():.4f} bits); cache {resolve_cache_dir(data)}"
    )
    return 0
