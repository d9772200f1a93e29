"""`gwtf swarm`: a local swarm of node processes on loopback, with churn and a live table.

Owns the command's flags (output folder, replicas per relay stage, churn level, WAN emulation,
iterations, overall timeout, swarm secret file: checked before any node starts, passed to each)
and the display loop: a live rich table on a terminal, one progress line every few seconds
otherwise (and a line whenever a stage is left without an active node: "stalled: stage K has no
node"). The processes, churn and metrics are `gwtf.runtime.swarm`.
Every node process started here is killed when this command ends, however it ends: normally, on
an error, on Ctrl+C (SIGINT), SIGTERM or SIGHUP (a closed terminal); a signal exits 128+signum.
A non-empty `--out` is refused (it holds an earlier run) unless the run is resumed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from gwtf.cli import add_config_arguments, add_secret_argument, apply_secret_file, non_negative_s
from gwtf.config import Config, load_config, write_resolved
from gwtf.errors import UserError

if TYPE_CHECKING:
    from gwtf.runtime.swarm import SwarmOptions

__all__ = ["add_arguments", "run", "run_swarm"]

POLL_S = 0.2  # display / churn polling period
LOOPBACK = ("127.0.0.1",)  # every node of a local swarm listens here (and joins through a peer here)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", default="runs/swarm", help="output folder (default: runs/swarm)")
    parser.add_argument("--data-holders", type=int, metavar="D", help="shorthand for --set train.data_holders=D")
    parser.add_argument("--stages", type=int, metavar="S", help="shorthand for --set model.stages=S (incl. stage 0)")
    parser.add_argument("--replicas", type=int, default=2, metavar="R", help="replicas of every relay stage")
    parser.add_argument("--churn", choices=("none", "low", "high"), default="none",
                        help="kill -9 relays at seeded random moments and start joiners")
    parser.add_argument("--wan", metavar="NETWORK", help="emulate a WAN region table on loopback (e.g. geo10)")
    parser.add_argument("--iterations", type=int, metavar="K", help="shorthand for --set train.iterations=K")
    parser.add_argument("--resume", action="store_true",
                        help="continue the stopped run in --out from its newest checkpoint complete for all stages")
    parser.add_argument("--slow", metavar="NODE=FACTOR", action="append", default=[],
                        help="make one initial node's compute FACTOR (>= 1) times slower, e.g. r1a=4 "
                             "(runtime.compute_slowdown for that node only; repeatable)")
    parser.add_argument("--timeout-s", type=float, default=0.0, metavar="S",
                        help="give up after S seconds (default, or 0: 120 + 30 per iteration)")
    add_secret_argument(parser)
    add_config_arguments(parser)


def _options(args: argparse.Namespace) -> tuple[Config, object]:
    from gwtf.runtime.swarm import SwarmOptions

    non_negative_s(args.timeout_s, "--timeout-s")
    overrides = list(args.overrides)
    for flag, key in (("iterations", "train.iterations"), ("data_holders", "train.data_holders"),
                      ("stages", "model.stages")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    regions: tuple[str, ...] = ("local",)
    if args.wan:
        from gwtf.flow.network import load_network

        overrides.append(f'runtime.wan="{args.wan}"')
        regions = load_network(args.wan).regions
    cfg: Config = apply_secret_file(load_config(args.config, overrides), args.secret_file, LOOPBACK)
    if args.replicas < 1:
        raise UserError("--replicas must be >= 1")
    check_swarm_config(cfg)
    timeout_s = args.timeout_s or 120.0 + 30.0 * cfg.train.iterations
    opts = SwarmOptions(out_dir=Path(args.out), replicas=args.replicas, churn=args.churn, timeout_s=timeout_s,
                        regions=regions, config_path=args.config, overrides=tuple(overrides), resume=args.resume)
    return cfg, replace(opts, slowdowns=parse_slowdowns(args.slow, cfg, opts))


def check_swarm_config(cfg: Config) -> None:
    """What a config must hold for a swarm beyond its own checks."""
    if cfg.train.iterations < 1:
        raise UserError("config: train.iterations must be >= 1 for a swarm (0 would never end)")


def parse_slowdowns(specs: list[str], cfg: Config, opts: object) -> dict[str, float]:
    """`--slow NODE=FACTOR` flags -> {node name: factor}; UserError naming a bad one."""
    from gwtf.runtime.swarm import SwarmOptions, initial_plans

    assert isinstance(opts, SwarmOptions)
    names = [p.name for p in initial_plans(cfg, opts)]
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            factor = float(text)
        except ValueError:
            factor = float("nan")
        if not sep or not 1.0 <= factor <= 1000.0:
            raise UserError(f"--slow {spec!r}: expected NODE=FACTOR with FACTOR in [1, 1000], e.g. r1a=4")
        if name not in names:
            raise UserError(f"--slow {spec!r}: no initial node {name!r} (nodes: {', '.join(names)})")
        out[name] = factor
    return out


def run(args: argparse.Namespace) -> int:
    from gwtf.runtime.swarm import previous_run

    out = Path(args.out)
    if args.resume and not previous_run(out):
        raise UserError(f"nothing to resume from: {out} holds no previous run")
    refuse_non_empty(out, bool(args.resume))
    cfg, opts = _options(args)
    return run_swarm(cfg, opts)


def refuse_non_empty(out: Path, resume: bool) -> None:
    """An earlier run's folder is never silently reused: its node logs and checkpoints would mix
    with (or be deleted by) the new run's."""
    if resume:
        return
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty (an earlier run?): use a new folder, delete this one, "
                        "or continue that run with --resume")


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) unwinds like Ctrl+C, so the Swarm context manager
    kills every node on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    for sig in STOP_SIGNALS:  # a second signal must not interrupt the clean-up
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextmanager
def _stop_signals() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into `Stopped` for the block (previous handlers restored)."""
    old: dict[int, Any] = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_swarm(cfg: Config, opts: object, title: str = "gwtf swarm") -> int:
    """Start, watch and finish a local swarm; returns the exit code (1 on timeout, 128+signum
    when stopped by a signal, after every node process was killed)."""
    try:
        with _stop_signals():
            return _run_swarm(cfg, opts, title)
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        sys.stderr.write(f"{title}: stopped by {name}; every node process was killed\n")
        return 128 + stop.signum


def _run_swarm(cfg: Config, opts: object, title: str) -> int:
    from rich.console import Console
    from rich.live import Live

    from gwtf.model.plots import plot_loss
    from gwtf.runtime.launcher import NodeStartError
    from gwtf.runtime.status import render_table, stalled_stages
    from gwtf.runtime.swarm import Swarm, SwarmOptions

    assert isinstance(opts, SwarmOptions)
    console = Console(stderr=True)
    cfg, opts = _resolve_data(cfg, opts, lambda text: console.print(f"{title}: {text}", markup=False, soft_wrap=True))
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, opts.out_dir)
    deadline = time.monotonic() + opts.timeout_s
    with Swarm(cfg, opts, say=lambda s: console.print(s)) as swarm:
        try:
            swarm.start()
        except NodeStartError as exc:
            console.print(str(exc), markup=False)
            raise UserError(f"swarm did not start: {str(exc).splitlines()[0]}") from None
        live_table = console.is_terminal
        last_line, last_row = 0.0, {"time_s": 0.0, "iteration": -1}
        window_tokens = 0
        stalled: list[int] = []
        with Live(render_table(swarm.table_rows(), title), console=console, auto_refresh=False,
                  transient=False) if live_table else _NoLive() as live:
            while not swarm.finished() and time.monotonic() < deadline:
                rows_now = swarm.table_rows()
                stalled = _stall_lines(stalled_stages(rows_now, cfg.model.stages), stalled,
                                       None if live_table else console)
                for row in swarm.step():
                    window_tokens += row["tokens"]
                    if not live_table and time.monotonic() - last_line > 3.0:
                        last_line = time.monotonic()
                        rate = window_tokens / max(1e-3, row["time_s"] - last_row["time_s"])
                        last_row, window_tokens = row, 0
                        console.print(f"iteration {row['iteration'] + 1}/{cfg.train.iterations} "
                                      f"loss {row['loss']:.4f} tok/s {rate:.0f} "
                                      f"crashes {row['crashes']} joins {row['joins']}")
                if live_table:
                    live.update(render_table(rows_now, title, stalled), refresh=True)
                time.sleep(POLL_S)  # display refresh period, not synchronisation
        swarm.close()  # training is over (or timed out): no node may run on past it
        rows = swarm.metrics.rows
        if rows:
            plot_loss(rows, opts.out_dir / "loss.png", title=title)
        if not swarm.finished():
            console.print(f"[red]timeout[/]: {len(rows)}/{cfg.train.iterations} iterations in {opts.timeout_s:.0f}s")
            return 1
    problems, totals = swarm.audit()
    if problems:
        console.print("[red]exactly-once ledger violated[/]:\n" + "\n".join(problems))
        return 1
    trained = swarm.metrics.next_iteration - swarm.first
    console.print(f"ledger: every microbatch counted exactly once at every stage in {trained} iterations "
                  f"({totals.get('expected', 0)} microbatch-stage contributions, {totals.get('dropped', 0)} "
                  "dropped with crashed data holders); replicas identical after every step")
    first, last = rows[0]["loss"], rows[-1]["loss"]
    resumed = f" (resumed at iteration {swarm.first})" if swarm.first else ""
    print(f"done: {len(rows)} iterations{resumed}, loss {first:.4f} -> {last:.4f}, crashes {swarm.crashes}, "
          f"joins {swarm.joins} (joiners that served, of {len(swarm.joiners)} started); outputs in {opts.out_dir} "
          "(metrics.jsonl, loss.png, nodes/)")
    return 0


def _resolve_data(cfg: Config, opts: SwarmOptions, say: Callable[[str], None]) -> tuple[Config, SwarmOptions]:
    """The data source decided once, here, before any node starts (an offline Shakespeare
    becomes "synthetic", announced on this console): every data holder gets it as an override
    and the resolved config records it."""
    from gwtf.model.data import resolve_source

    data = resolve_source(cfg.data, say)
    if data == cfg.data:
        return cfg, opts
    return replace(cfg, data=data), replace(opts, overrides=(*opts.overrides, f'data.source="{data.source}"'))


def _stall_lines(now: list[int], before: list[int], console: Any) -> list[int]:
    """Off a terminal: print a line when a stage stalls or is served again. Returns `now`."""
    from gwtf.runtime.status import stalled_lines

    if console is not None and now != before:
        for line in stalled_lines(k for k in now if k not in before):
            console.print(line, markup=False)
        for k in (k for k in before if k not in now):
            console.print(f"stage {k} is served again", markup=False)
    return now


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *a: object, **k: object) -> None:
        return None

