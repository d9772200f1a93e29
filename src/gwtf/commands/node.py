"""`gwtf node`: run one node process (data holder or relay) over TCP.

Owns the command's flags: process identity only (listen/join addresses, role, stage, region, data
shard, device, output folder, name, swarm secret and static key files); every algorithm knob is a
config field (`--config`, `--set`). A secret or key file that would not do (docs/security.md) is
refused here, in one line, before torch is imported. The node itself is `gwtf.runtime.node`;
it prints one `READY {json}` line when it listens and one `SERVING {json}` line when it serves.

Also owns the node's `DIR/nodes/<name>/stdout.log`: everything the node prints to stdout and
stderr at the Python level is appended there as well as shown on the terminal (`tee_output`),
unless the process's stdout already is that file (`gwtf swarm`'s launcher redirects it there).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import secrets
import sys
import threading
from pathlib import Path
from typing import IO, TextIO, cast

from gwtf.cli import (
    add_config_arguments,
    add_device_argument,
    add_secret_argument,
    apply_secret_file,
    check_device,
    device_overrides,
    out_folder,
)
from gwtf.config import Config, load_config
from gwtf.errors import UserError

__all__ = ["add_arguments", "run", "tee_output"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:0",
                        help="address to listen on (port 0 = any free port; default 127.0.0.1:0)")
    parser.add_argument("--join", metavar="HOST:PORT", help="any live node of the swarm (omit for the first node)")
    parser.add_argument("--role", choices=("data-holder", "relay"), default="relay",
                        help="data-holder: stage 0 (embedding, head, loss) with a data shard; relay (default): "
                             "a middle stage")
    parser.add_argument("--stage", default="auto", help="'auto' (joiners: the bottleneck stage) or a stage number")
    parser.add_argument("--region", default="local", help="region name (WAN emulation looks it up)")
    parser.add_argument("--shard", type=int, metavar="K",
                        help="data holders: data shard 0..D-1 (default: the last number in --name, else 0)")
    parser.add_argument("--name", help="short node name (default: random); the node id adds region and address")
    parser.add_argument("--wan", metavar="NETWORK", help="shorthand for --set runtime.wan=NETWORK (e.g. geo10)")
    parser.add_argument("--out", metavar="DIR", default="runs/swarm", help="output folder (DIR/nodes/<name>/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a stopped swarm: the first node (no --join) starts from the newest "
                             "checkpoint in DIR/checkpoints complete for all stages; others follow it")
    parser.add_argument("--key-file", metavar="PATH",
                        help="the node's static key (created, mode 0600, if missing; default: "
                             "DIR/nodes/<name>/node.key); its fingerprint is part of the node id")
    add_device_argument(parser)
    add_secret_argument(parser)
    add_config_arguments(parser)


def _hosts(listen: str, join: str | None) -> list[str]:
    """The hosts of --listen and --join (UserError naming the flag if one is malformed)."""
    from gwtf.runtime.transport import parse_addr

    hosts = []
    any_port = listen[:-2] + ":1" if listen.endswith(":0") else listen  # port 0 = any free port
    for flag, addr in (("--listen", any_port), ("--join", join)):
        if addr:
            try:
                hosts.append(parse_addr(addr)[0])
            except ValueError as exc:
                raise UserError(f"{flag}: {exc}") from None
    return hosts


def check_listen(listen: str) -> None:
    """A port already in use, an address not of this machine or an unknown host name is a user
    error found here, before torch is imported (the node's own bind reports the same if the
    port is taken in between)."""
    import socket

    host, _, port = listen.rpartition(":")  # well-formed: `_hosts` checked it
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in infos:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the node's server does
                sock.bind(addr)
    except OSError as exc:
        from gwtf.runtime.transport import listen_problem

        raise UserError(f"--listen {listen}: {listen_problem(exc)}") from None


def _stage(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise UserError(f"--stage must be 'auto' or a stage number, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f'runtime.wan="{args.wan}"'] if args.wan else []) + device_overrides(args)
    cfg: Config = load_config(args.config, overrides)
    from gwtf.runtime.chaos import runtime_fault

    runtime_fault(cfg.runtime.fault)  # a malformed fault spec is a user error before anything starts
    if cfg.train.iterations < 1:
        raise UserError("config: train.iterations must be >= 1 for a node (0 would never end)")
    hosts = _hosts(args.listen, args.join)
    check_listen(args.listen)
    cfg = apply_secret_file(cfg, args.secret_file, hosts)
    name = args.name or f"n{secrets.token_hex(3)}"
    if not _NAME.match(name):
        raise UserError(f"--name {name!r}: use 1-40 letters, digits, '_', '.', '-'")
    stage = _stage(args.stage)
    if stage is not None and not 0 <= stage < cfg.model.stages:
        raise UserError(f"--stage {stage} is outside 0..{cfg.model.stages - 1} (model.stages)")
    if args.role == "data-holder":
        stage = 0
    _check_fault_role(cfg, args.role, stage)
    shard = args.shard
    if args.role == "data-holder" and shard is None:
        digits = re.findall(r"\d+", args.name or "")  # a random name's hex digits are no shard
        shard = int(digits[-1]) if digits else 0
    if shard is not None and not 0 <= shard < cfg.train.data_holders:
        raise UserError(f"--shard {shard} is outside 0..{cfg.train.data_holders - 1} (train.data_holders)")
    if cfg.runtime.wan:
        from gwtf.flow.network import load_network

        net = load_network(cfg.runtime.wan)
        if args.region not in net.regions:
            raise UserError(f"--region {args.region!r} is not in network {cfg.runtime.wan} ({', '.join(net.regions)})")
    device = check_device(cfg, args)  # before anything is written
    out_folder(args.out)
    _check_out(Path(args.out), name, args.join is None, args.resume, cfg)
    key_file = _check_key(args.key_file, Path(args.out), name)
    from gwtf.runtime.node import NodeIdentity, run_node  # torch only once we really run
    from gwtf.runtime.status import STDOUT_FILE, node_dir

    tee_output(node_dir(args.out, name) / STDOUT_FILE)
    ident = NodeIdentity(
        name=name, role=args.role, stage=stage, region=args.region, shard=shard, listen=args.listen,
        join=args.join, device=device, out_dir=Path(args.out), resume=args.resume, key_file=key_file,
    )
    return run_node(cfg, ident)


def _check_fault_role(cfg: Config, role: str, stage: int | None) -> None:
    """This node's fault (runtime.fault, else $GWTF_FAULT) must be one its role can fire
    (`faults.check_role`): a data holder's (stage 0 for good) and a relay's given a relay stage
    (`--stage K`, K >= 1: it only ever moves between relay stages). A relay with `--stage auto`
    is not checked: the leader may make it a data holder (a vacant shard), or a relay."""
    from gwtf.protocol.faults import check_role
    from gwtf.runtime.chaos import FAULT_ENV, runtime_fault

    text = cfg.runtime.fault or os.environ.get(FAULT_ENV, "")  # as `chaos.fault_from` chooses
    fault = runtime_fault(text)
    if fault is not None and (role == "data-holder" or (stage or 0) >= 1):
        flags = f"--role {role}" + (f" --stage {stage}" if role == "relay" else "")
        check_role(fault, role, f"runtime.fault {text.strip()!r} ({flags})", cfg.model.stages)


def _check_key(key_file: str | None, out: Path, name: str) -> Path | None:
    """`--key-file` (created if missing) or an existing key in the node's folder must be a
    well-formed key readable by its owner only (UserError otherwise); returns --key-file's path."""
    from gwtf.runtime import keys

    path = Path(key_file).expanduser().absolute() if key_file else out / "nodes" / name / keys.KEY_FILE
    if key_file or path.exists():
        keys.load_or_create_key(path)
    return path if key_file else None


def _check_out(out: Path, name: str, bootstrap: bool, resume: bool, cfg: Config) -> None:
    """Without --resume, a node's folder of an earlier run (or, for the first node, an earlier
    run's checkpoints) is refused; with it, the first node needs something to resume from."""
    from gwtf.runtime import checkpoints
    from gwtf.runtime.status import RECORDS_FILE

    ckpt = out / checkpoints.CHECKPOINTS_DIR
    if not resume:
        if (out / "nodes" / name / RECORDS_FILE).exists() or (bootstrap and ckpt.is_dir()):
            raise UserError(f"{out} holds a previous run (node {name}): pass --resume to continue it, "
                            "or use another --out")
        return
    if bootstrap:
        checkpoints.resume_version(ckpt, cfg.model.stages, cfg.train.iterations, cfg.protocol.checkpoint_every,
                                   ended=checkpoints.training_ended(out / "nodes" / name / RECORDS_FILE))


class _Tee(io.TextIOBase):
    """A text stream writing to the original stream (the terminal) and to the node's log file.
    stdout's and stderr's tees share the file and one lock, so their lines interleave in the
    file as they were written. `fileno()` and `isatty()` are the original's (faulthandler
    needs a real descriptor). Neither side's failure stops the node: a terminal that went away
    (EIO, EPIPE) is dropped for good, a log write that failed (a full disk) is skipped."""

    def __init__(self, stream: TextIO, log_file: IO[str], lock: threading.RLock) -> None:
        super().__init__()
        self._stream: TextIO | None = stream
        self._original = stream
        self._log = log_file
        self._lock = lock

    def write(self, text: str) -> int:
        with self._lock:
            if self._stream is not None:
                try:
                    self._stream.write(text)
                except (OSError, ValueError):  # the terminal is gone (or closed): keep logging
                    self._stream = None
            try:
                self._log.write(text)
                self._log.flush()  # as records.jsonl: a kill -9 loses no whole line
            except (OSError, ValueError):
                pass  # e.g. the disk is full: the terminal still shows it
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._stream is not None:
                try:
                    self._stream.flush()
                except (OSError, ValueError):
                    self._stream = None
            try:
                self._log.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Flush only: both streams outlive this wrapper (IOBase's finalizer calls close)."""
        self.flush()

    def fileno(self) -> int:
        return self._original.fileno()

    def isatty(self) -> bool:
        return self._original.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._original, "encoding", None) or "utf-8"


def _is_file(stream: TextIO, stat: os.stat_result) -> bool:
    """Does `stream` write to the file `stat` describes (same device and inode)?"""
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (stat.st_dev, stat.st_ino)


def tee_output(path: Path) -> IO[str] | None:
    """Append everything printed to `sys.stdout` and `sys.stderr` to `path` too (a tee at the
    Python level: output of C code to fd 1 or 2 reaches the terminal only). A stream that
    already writes to `path` (`gwtf swarm`'s launcher redirects both there) is left alone, so
    no line is doubled. Returns the opened log file, or None when nothing needed a tee."""
    try:
        stat: os.stat_result | None = os.stat(path)
    except OSError:
        stat = None
    names = [n for n in ("stdout", "stderr") if stat is None or not _is_file(getattr(sys, n), stat)]
    if not names:
        return None
    log_file = path.open("a", encoding="utf-8", errors="backslashreplace")
    lock = threading.RLock()  # reentrant: a Python signal handler may print in the middle of a write
    for n in names:
        setattr(sys, n, cast(TextIO, _Tee(getattr(sys, n), log_file, lock)))
    return log_file
