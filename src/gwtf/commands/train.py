"""`gwtf train --local`: the single-process reference trainer, with a progress display.

Owns: the command's flags (process identity and paths only: --local, --out, --iterations,
--time-limit-s, --resume, --device, plus --config/--set) and the progress bar / plain progress lines.
The training itself is `gwtf.model.trainer.train_local`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from gwtf.cli import add_config_arguments, add_device_argument, check_device, device_overrides, out_folder
from gwtf.config import Config, load_config
from gwtf.errors import UserError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="train in this one process (reference trainer)")
    parser.add_argument("--out", metavar="DIR", default="runs/local", help="output folder (default: runs/local)")
    parser.add_argument("--iterations", type=int, metavar="K", help="shorthand for --set train.iterations=K")
    parser.add_argument(
        "--time-limit-s", type=float, metavar="S", help="stop (and checkpoint) after S seconds of wall time"
    )
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint")
    add_device_argument(parser)
    add_config_arguments(parser)


def _resolve(args: argparse.Namespace) -> Config:
    cfg: Config = load_config(args.config, list(args.overrides) + device_overrides(args))
    train = cfg.train
    if args.iterations is not None:
        train = dataclasses.replace(train, iterations=args.iterations)
    if args.time_limit_s is not None:
        train = dataclasses.replace(train, time_limit_s=args.time_limit_s)
    return dataclasses.replace(cfg, train=train)


class _PlainProgress:
    """One status line every few seconds, for logs and non-terminals."""

    def __init__(self, total: int, every_s: float = 5.0) -> None:
        self.total, self.every_s, self.last = total, every_s, -1e9

    def __call__(self, row: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s or row["iteration"] + 1 == self.total or row["iteration"] == 0:
            self.last = now
            val = f" val_loss {row['val_loss']:.4f}" if row.get("val_loss") is not None else ""
            sys.stderr.write(
                f"iteration {row['iteration'] + 1}/{self.total} loss {row['loss']:.4f}{val} "
                f"tok/s {row['tokens_per_s']:.0f} time {row['time_s']:.0f}s\n"
            )


def run(args: argparse.Namespace) -> int:
    if not args.local:
        raise UserError("gwtf train needs --local (one process); for a multi-node run use `gwtf swarm`")
    cfg = _resolve(args)
    check_device(cfg, args)
    out_folder(args.out)
    from gwtf.model.trainer import train_local  # torch import only once we know we train

    total = cfg.train.iterations
    if sys.stderr.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = (
            TextColumn("[bold]train[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task("train", total=total, loss="-", tps="-")

            def show(row: dict[str, Any]) -> None:
                bar.update(task, completed=row["iteration"] + 1, loss=f"{row['loss']:.4f}",
                           tps=f"{row['tokens_per_s']:.0f}")

            result = train_local(cfg, args.out, resume=args.resume, on_iteration=show)
    else:
        result = train_local(cfg, args.out, resume=args.resume, on_iteration=_PlainProgress(total))
    ds = result.dataset
    first = result.metrics[0]["loss"] if result.metrics else float("nan")
    last = result.metrics[-1]["loss"] if result.metrics else float("nan")
    end = result.metrics[-1] if result.metrics else {}
    val = end.get("val_loss", end.get("val_loss_at_stop"))
    val_text = f" (val {val:.4f})" if val is not None else ""
    status = "stopped early (resume with --resume)" if result.stopped_early else "done"
    print(
        f"{status}: {result.completed}/{total} iterations, loss {first:.4f} -> {last:.4f}{val_text}; data {ds.name}, "
        f"vocab {ds.vocab_size}, unigram entropy {ds.unigram_entropy_nats():.4f} nats "
        f"({ds.unigram_entropy_bits():.4f} bits); outputs in {args.out}"
    )
    return 0
