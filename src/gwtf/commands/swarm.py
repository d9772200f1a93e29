"""`gwtf swarm`: a local swarm of node processes on loopback, with churn and a live table.

Owns the command's flags (output folder, replicas per relay stage, churn level and the nodes it
spares, WAN emulation,
iterations, overall timeout, device (= train.device, passed to each node), swarm secret file, per-node
slowdowns and `--fault NODE=SPEC` chaos faults: checked before any node starts, passed to each)
and the display loop: on a terminal a live rich table under a swarm-wide header (iteration X/K,
ETA, loss, tokens/s, members by stage, crashes and joins: `gwtf.runtime.watch`), one progress
line every few seconds otherwise (and a line whenever a stage is left without an active node:
"stalled: stage K has no node"). The processes, churn and metrics are `gwtf.runtime.swarm`;
the validation loss of the checkpoints `gwtf.runtime.validation`. loss.png is written however
the run ends (finished, timed out, Ctrl+C), from the iterations completed.
Every node process started here is killed when this command ends, however it ends: normally, on
an error, on Ctrl+C (SIGINT), SIGTERM or SIGHUP (a closed terminal); a signal exits 128+signum.
A non-empty `--out` is refused (it holds an earlier run) unless the run is resumed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from gwtf.cli import (
    add_config_arguments,
    add_device_argument,
    add_secret_argument,
    apply_secret_file,
    check_device,
    device_overrides,
    non_negative_s,
)
from gwtf.config import Config, load_config, write_resolved
from gwtf.errors import UserError

if TYPE_CHECKING:
    from gwtf.runtime.swarm import SwarmOptions

__all__ = ["add_arguments", "run", "run_swarm"]

POLL_S = 0.2  # display / churn polling period
CHURN_SPARE = ("none", "leader", "data-holders")  # = runtime.swarm.CHURN_SPARE (not imported: --help stays light)
T = TypeVar("T")
LOOPBACK = ("127.0.0.1",)  # every node of a local swarm listens here (and joins through a peer here)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", default="runs/swarm", help="output folder (default: runs/swarm)")
    parser.add_argument("--data-holders", type=int, metavar="D", help="shorthand for --set train.data_holders=D")
    parser.add_argument("--stages", type=int, metavar="S", help="shorthand for --set model.stages=S (incl. stage 0)")
    parser.add_argument("--replicas", type=int, default=2, metavar="R", help="replicas of every relay stage")
    parser.add_argument("--churn", choices=("none", "low", "high"), default="none",
                        help="kill -9 random nodes (relays, data holders, the leader) at seeded random moments "
                             "and start joiners")
    parser.add_argument("--churn-spare", choices=CHURN_SPARE, default="none",
                        help="nodes --churn never kills: none (default), the leader, or every data holder")
    parser.add_argument("--wan", metavar="NETWORK", help="emulate a WAN region table on loopback (e.g. geo10)")
    parser.add_argument("--iterations", type=int, metavar="K", help="shorthand for --set train.iterations=K")
    parser.add_argument("--resume", action="store_true",
                        help="continue the stopped run in --out from its newest checkpoint complete for all stages")
    parser.add_argument("--slow", metavar="NODE=FACTOR", action="append", default=[],
                        help="make one initial node's compute FACTOR (>= 1) times slower, e.g. r1a=4 "
                             "(runtime.compute_slowdown for that node only; repeatable)")
    parser.add_argument("--fault", dest="faults", metavar="NODE=SPEC", action="append", default=[],
                        help="give one initial node a scripted fault (runtime.fault for that node only; "
                             "repeatable), e.g. r1a=crash:compute=backward:from=2 (docs/faults.md)")
    parser.add_argument("--timeout-s", type=float, default=0.0, metavar="S",
                        help="give up after S seconds (default, or 0: 120 + 30 per iteration)")
    add_device_argument(parser)
    add_secret_argument(parser)
    add_config_arguments(parser)


def _options(args: argparse.Namespace) -> tuple[Config, object]:
    from gwtf.runtime.swarm import SwarmOptions

    non_negative_s(args.timeout_s, "--timeout-s")
    overrides = list(args.overrides) + device_overrides(args)
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
    check_device(cfg, args)  # every node of a local swarm shares this machine's devices
    check_swarm_config(cfg)
    timeout_s = args.timeout_s or 120.0 + 30.0 * cfg.train.iterations
    opts = SwarmOptions(out_dir=Path(args.out), replicas=args.replicas, churn=args.churn, timeout_s=timeout_s,
                        regions=regions, config_path=args.config, overrides=tuple(overrides), resume=args.resume,
                        churn_spare=args.churn_spare)
    opts = replace(opts, slowdowns=parse_slowdowns(args.slow, cfg, opts),
                   faults=parse_node_faults(args.faults, cfg, opts))
    check_shared_fault(cfg, opts)
    return cfg, opts


def parse_node_faults(specs: list[str], cfg: Config, opts: object) -> dict[str, str]:
    """`--fault NODE=SPEC` flags -> {node name: spec}; UserError naming a bad one, or one that can
    never fire on its node's role (`faults.check_role`: e.g. a data holder's compute kind on a
    relay, a relay's on a data holder)."""
    from gwtf.protocol.faults import check_role
    from gwtf.runtime.chaos import runtime_fault
    from gwtf.runtime.swarm import SwarmOptions, initial_plans

    def spec(text: str) -> str:
        runtime_fault(text)  # FaultError (one line, exit 2) before any process starts
        return text

    assert isinstance(opts, SwarmOptions)
    roles = {p.name: p.role for p in initial_plans(cfg, opts)}
    out = _per_node_flags("--fault", "NODE=SPEC, e.g. r1a=crash:compute=forward:iter=2", "a fault",
                          specs, list(roles), spec)
    for name, text in out.items():
        fault = runtime_fault(text)
        if fault is not None:
            check_role(fault, roles[name], f"--fault {name + '=' + text!r} (node {name})", cfg.model.stages)
    return out


def check_shared_fault(cfg: Config, opts: object) -> None:
    """A fault every node inherits (runtime.fault through --set/--config, else $GWTF_FAULT) must be
    one that can fire on each initial node that gets it (every one without its own --fault), which
    would refuse it and not start otherwise. A joiner (`--stage auto`: a relay stage, or the data
    holder's role on a vacant shard) is not checked: it may run any kind."""
    from gwtf.protocol.faults import check_role
    from gwtf.runtime.chaos import FAULT_ENV, runtime_fault
    from gwtf.runtime.swarm import SwarmOptions, initial_plans

    assert isinstance(opts, SwarmOptions)
    text = cfg.runtime.fault or os.environ.get(FAULT_ENV, "")  # as each node's `chaos.fault_from` chooses
    fault = runtime_fault(text)
    if fault is None:
        return
    for name, role in ((p.name, p.role) for p in initial_plans(cfg, opts) if p.name not in opts.faults):
        check_role(fault, role, f"runtime.fault {text.strip()!r} (every node without its own --fault, "
                                f"here {name})", cfg.model.stages)


def check_swarm_config(cfg: Config) -> None:
    """What a config must hold for a swarm beyond its own checks."""
    if cfg.train.iterations < 1:
        raise UserError("config: train.iterations must be >= 1 for a swarm (0 would never end)")


def parse_slowdowns(specs: list[str], cfg: Config, opts: object) -> dict[str, float]:
    """`--slow NODE=FACTOR` flags -> {node name: factor}; UserError naming a bad one."""

    def factor(text: str) -> float:
        value = float(text)
        if not 1.0 <= value <= 1000.0:
            raise ValueError(text)
        return value

    return _per_node_flags("--slow", "NODE=FACTOR with FACTOR in [1, 1000], e.g. r1a=4", "a slowdown",
                           specs, _initial_names(cfg, opts), factor)


def _initial_names(cfg: Config, opts: object) -> list[str]:
    from gwtf.runtime.swarm import SwarmOptions, initial_plans

    assert isinstance(opts, SwarmOptions)
    return [p.name for p in initial_plans(cfg, opts)]


def _per_node_flags(flag: str, expected: str, what: str, specs: list[str], names: list[str],
                    parse: Callable[[str], T]) -> dict[str, T]:
    """`FLAG NODE=VALUE` flags -> {node: parse(VALUE)}, checked in order: shape, node, one per node,
    value. `parse` raises ValueError for a bad value (reported as `expected`); a UserError it raises
    (a fault grammar error) is its own one-line message."""
    out: dict[str, T] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        if not sep or not text:
            raise UserError(f"{flag} {spec!r}: expected {expected}")
        if name not in names:
            raise UserError(f"{flag} {spec!r}: no initial node {name!r} (nodes: {', '.join(names)})")
        if name in out:
            raise UserError(f"{flag} {spec!r}: node {name!r} has {what} already (one per node)")
        try:
            out[name] = parse(text)
        except UserError:
            raise
        except ValueError:
            raise UserError(f"{flag} {spec!r}: expected {expected}") from None
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

    from gwtf.runtime.audit import batch_text, short_lines
    from gwtf.runtime.launcher import NodeStartError
    from gwtf.runtime.swarm import Swarm, SwarmOptions
    from gwtf.runtime.validation import CheckpointValidation

    assert isinstance(opts, SwarmOptions)
    console = Console(stderr=True)
    cfg, opts = _resolve_data(cfg, opts, lambda text: console.print(f"{title}: {text}", markup=False, soft_wrap=True))
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, opts.out_dir)
    validation = CheckpointValidation(cfg, opts.out_dir, say=lambda s: console.print(s, markup=False))
    with Swarm(cfg, opts, say=lambda s: console.print(s), validation=validation) as swarm:
        try:
            swarm.start()
        except NodeStartError as exc:
            console.print(str(exc), markup=False)
            raise UserError(f"swarm did not start: {str(exc).splitlines()[0]}") from None
        try:
            _watch(swarm, cfg, title, console, time.monotonic() + opts.timeout_s)
        finally:  # Ctrl+C too: no node runs on past the command, and the plot shows what was trained
            swarm.close()
            _plot(swarm.metrics.rows, opts.out_dir, title)
        rows = swarm.metrics.rows
        if not swarm.finished():
            console.print(f"[red]timeout[/]: {len(rows)}/{cfg.train.iterations} iterations in {opts.timeout_s:.0f}s")
            return 1
    problems, totals = swarm.audit()
    if problems:
        console.print("[red]exactly-once ledger violated[/]:\n" + "\n".join(problems))
        return 1
    trained = swarm.metrics.next_iteration - swarm.first
    console.print(f"ledger: every microbatch counted exactly once at every stage in {trained} iterations "
                  f"({totals.get('expected', 0)} microbatch-stage contributions; {batch_text(totals)}); "
                  "replicas identical after every step", markup=False)
    for line in short_lines(totals):
        console.print(f"short: {line}", markup=False)
    first, last = rows[0]["loss"], rows[-1]["loss"]
    resumed = f" (resumed at iteration {swarm.first})" if swarm.first else ""
    val = next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None)
    val_text = f", val loss {val:.4f}" if val is not None else ""
    print(f"done: {len(rows)} iterations{resumed}, loss {first:.4f} -> {last:.4f}{val_text}, crashes {swarm.crashes}, "
          f"joins {swarm.joins} (joiners that served, of {len(swarm.joiners)} started){holders_text(swarm)}; "
          f"outputs in {opts.out_dir} (metrics.jsonl, loss.png, nodes/)")
    return 0


def holders_text(swarm: Any) -> str:
    """The `done:` line's data holders churn killed and joiners that replaced one (stepped as a
    data holder on the vacant shard): ", data holders killed 1 (dh1), replaced 1 (j1)"; "" when none."""
    killed, replaced = swarm.holders_killed, swarm.holders_replaced
    if not killed and not replaced:
        return ""

    def names(xs: list[str]) -> str:
        return f" ({', '.join(xs)})" if xs else ""

    return f", data holders killed {len(killed)}{names(killed)}, replaced {len(replaced)}{names(replaced)}"


def _resolve_data(cfg: Config, opts: SwarmOptions, say: Callable[[str], None]) -> tuple[Config, SwarmOptions]:
    """The data source decided once, here, before any node starts (an offline Shakespeare
    becomes "synthetic", announced on this console): every data holder gets it as an override
    and the resolved config records it."""
    from gwtf.model.data import resolve_source
    from gwtf.model.pretrained import resolve_init

    cfg = resolve_init(cfg)  # model.init_from's shape and tokenizer, in the resolved config too (nodes resolve alike)
    data = resolve_source(cfg.data, say)
    if data == cfg.data:
        return cfg, opts
    return replace(cfg, data=data), replace(opts, overrides=(*opts.overrides, f'data.source="{data.source}"'))


def _plot(rows: list[dict[str, Any]], out_dir: Path, title: str) -> None:
    from gwtf.model.plots import plot_loss

    if rows:
        plot_loss(rows, out_dir / "loss.png", title=title)


def _watch(swarm: Any, cfg: Config, title: str, console: Any, deadline: float) -> None:
    """Poll the swarm until it finished or the deadline: the live header + table on a terminal,
    a progress line every few seconds otherwise."""
    from rich.live import Live

    from gwtf.runtime.status import stalled_stages
    from gwtf.runtime.watch import render_watch

    def view(rows_now: list[dict[str, Any]], stalled: list[int]) -> Any:
        return render_watch(rows_now, title, stalled, cfg.train.iterations, swarm.crashes, swarm.joins)

    live_table = console.is_terminal
    last_line, last_row = 0.0, {"time_s": 0.0, "iteration": -1}
    window_tokens = 0
    stalled: list[int] = []
    with Live(view(swarm.table_rows(), []), console=console, auto_refresh=False,
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
                    val = f" val {row['val_loss']:.4f}" if row.get("val_loss") is not None else ""
                    console.print(f"iteration {row['iteration'] + 1}/{cfg.train.iterations} "
                                  f"loss {row['loss']:.4f}{val} tok/s {rate:.0f} "
                                  f"crashes {row['crashes']} joins {row['joins']}")
            if live_table:
                live.update(view(rows_now, stalled), refresh=True)
            time.sleep(POLL_S)  # display refresh period, not synchronisation


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

