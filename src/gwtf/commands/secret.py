"""`gwtf secret new PATH`: write a fresh swarm secret file.

Owns the command's flags and its output: the path written and how to hand the secret to nodes
(`--secret-file PATH` on `gwtf node` / `gwtf swarm` / `gwtf demo`, or $GWTF_SWARM_SECRET). The
file format (256 random bits as 64 hex digits, mode 0600, never overwritten) is
`gwtf.runtime.keys.write_new_secret`. The secret itself is never printed.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    new = actions.add_parser("new", help="write a new 256-bit secret to PATH (mode 0600; never overwrites)",
                             description="write a new 256-bit swarm secret to PATH (mode 0600; never overwrites)")
    new.add_argument("path", metavar="PATH", help="file to create, e.g. swarm.secret")


def run(args: argparse.Namespace) -> int:
    from gwtf.runtime import keys

    path = Path(args.path)
    keys.write_new_secret(path)
    bits = 8 * keys.NEW_SECRET_BYTES
    arg = shlex.quote(str(path))
    print(f"wrote a new {bits}-bit swarm secret to {path} (mode 0600)")
    print("copy it to every machine of the swarm, then pass it to every node:")
    print(f"  gwtf node --secret-file {arg} ...   (also gwtf swarm / gwtf demo --secret-file {arg})")
    print(f'  or: export {keys.SECRET_ENV}="$(cat {arg})"')
    return 0
