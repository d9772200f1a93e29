"""`gwtf status HOST:PORT`: the live table of a running swarm, asked from any of its members.

Owns the command's flags (the member's address, the swarm secret file, a deadline, `--json`).
The member answers over the authenticated wire (`gwtf.runtime.statusrpc`): the client holds the
swarm secret like every node (`--secret-file`, else runtime.secret_file of `--config`, else
$GWTF_SWARM_SECRET, else the development secret on loopback only). It prints the header and
table `gwtf swarm` draws (`gwtf.runtime.watch`), or the rows as JSON. On a pipe or a file (stdout
no terminal) the table is printed as wide as it needs, every column in full, and a hint to use
`--json` goes to stderr once. Unreachable member, wrong secret (the member refuses the handshake)
or no answer in time: one line, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from gwtf.cli import add_config_arguments, add_secret_argument
from gwtf.config import Config, load_config
from gwtf.errors import UserError

__all__ = ["JSON_HINT", "add_arguments", "run"]

JSON_HINT = "(use --json for machine-readable output)"  # once, on stderr, when stdout is no terminal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("addr", metavar="HOST:PORT", help="any live member of the swarm (its READY line's host:port)")
    parser.add_argument("--timeout-s", type=float, default=10.0, metavar="S",
                        help="give up after S seconds without an answer (default 10)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object instead of the table")
    add_secret_argument(parser)
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from gwtf.runtime import keys
    from gwtf.runtime.statusrpc import fetch_status
    from gwtf.runtime.transport import SendFailed, parse_addr

    try:
        host, _ = parse_addr(args.addr)
    except ValueError as exc:
        raise UserError(f"HOST:PORT: {exc}") from None
    if not args.timeout_s > 0:
        raise UserError("--timeout-s must be > 0")
    cfg: Config = load_config(args.config, args.overrides)
    secret = keys.load_secret(args.secret_file or cfg.runtime.secret_file or None, hosts=[host])
    try:
        rows = asyncio.run(fetch_status(args.addr, secret, args.timeout_s,
                                        connect_timeout_s=min(args.timeout_s, cfg.runtime.connect_timeout_s)))
    except SendFailed as exc:
        raise UserError(f"no status from {args.addr}: {exc.reason}") from None
    except ValueError as exc:
        raise UserError(f"{args.addr} did not answer: {exc}") from None
    if args.json:
        print(json.dumps({"addr": args.addr, "rows": rows}, sort_keys=True))
        return 0
    from rich.console import Console

    from gwtf.runtime.status import stalled_stages
    from gwtf.runtime.watch import print_full_width, render_watch

    stages = max((v + (k == "stage") for r in rows for k in ("stage", "stages")
                  if isinstance(v := r.get(k), int)), default=0)
    console = Console()
    print_full_width(console, render_watch(rows, f"gwtf swarm at {args.addr}", stalled_stages(rows, stages)))
    if not console.is_terminal:
        print(JSON_HINT, file=sys.stderr)
    return 0
