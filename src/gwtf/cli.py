"""Command-line entry point: `gwtf <command> ...`.

Owns: argument parsing and the mapping of user errors to one line on stderr + exit code 2.
Each subcommand lives in `gwtf.commands.<name>` with two functions:
`add_arguments(parser)` and `run(args) -> int`. The CLI stays thin: algorithm knobs are config
fields (`--config FILE`, `--set section.key=value`), not flags. Also the flags shared by several
commands: the config pair, `--secret-file` of every command that starts nodes (checked before
any process starts: `apply_secret_file`), and `--device` of every command that trains (it stands
for `train.device`; `check_device` refuses cuda without CUDA in one line).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gwtf import __version__
from gwtf.errors import NothingToDo, UserError

if TYPE_CHECKING:
    from gwtf.config import Config

# name -> one-line help. Order is the order shown in `gwtf --help`.
COMMANDS: dict[str, str] = {
    "demo": "run a local swarm demo with churn on embedded defaults",
    "train": "train a model (--local: one process, the reference trainer)",
    "data": "prepare and inspect data sets (gwtf data prepare shakespeare)",
    "route": "build a routing instance and compare gwtf's flow routing with the optimum and baselines",
    "simulate": "run a geo-distributed churn scenario in the discrete-event simulator",
    "node": "run one node process (relay or data holder) over TCP",
    "swarm": "start a local swarm of node processes on loopback",
    "status": "print the live table of a running swarm, asked from any member (HOST:PORT)",
    "audit": "check the exactly-once ledger of a swarm run from its node folders (gathered from every machine)",
    "secret": "create a swarm secret file (gwtf secret new PATH)",
    "generate": "generate text from a trained checkpoint (local or swarm), streamed",
    "export": "export a trained checkpoint as a Hugging Face folder (GPT-2 or Llama)",
    "import": "import a Hugging Face GPT-2 or Llama folder as a gwtf checkpoint (gwtf import --hf DIR --out DIR)",
    "eval": "held-out loss and perplexity of a checkpoint (local, swarm, imported or a Hugging Face folder)",
    "config": "print the resolved config, or (--docs) the reference of every config key",
}

MODULES = {"import": "import_"}  # command -> module, where the command is a Python keyword


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"gwtf: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gwtf", description="Churn-tolerant decentralized training of LLMs.")
    parser.add_argument("--version", action="version", version=f"gwtf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        module_name = f"gwtf.commands.{MODULES.get(name, name)}"
        if importlib.util.find_spec(module_name) is None:
            continue  # command not built yet
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The two config flags every config-driven command takes."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    parser.add_argument(
        "--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
        help="override one config value (repeatable), e.g. --set train.lr=3e-4",
    )


def add_secret_argument(parser: argparse.ArgumentParser) -> None:
    """`--secret-file PATH` of every command that starts nodes (= runtime.secret_file)."""
    parser.add_argument(
        "--secret-file", metavar="PATH",
        help="swarm secret (write one with `gwtf secret new PATH`); default: runtime.secret_file, else "
             "$GWTF_SWARM_SECRET, else a public development secret, accepted on loopback addresses only",
    )


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device` of every command that trains (= train.device for this run; docs/gpu.md)."""
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default=None,
        help="where stages compute: auto = cuda when available, else cpu (default: train.device, "
             "itself 'auto')",
    )


def device_overrides(args: argparse.Namespace) -> list[str]:
    """`--device D` as the config override it stands for (`train.device="D"`), or nothing."""
    device = getattr(args, "device", None)
    return [f'train.device="{device}"'] if device else []


def check_device(cfg: Config, args: argparse.Namespace) -> str:
    """The device train.device resolves to here; UserError (one line, naming `--device` when the
    flag was given) for cuda without CUDA. Imports torch: call it once the rest is checked."""
    from gwtf.model.device import resolve_device

    return resolve_device(cfg.train.device, "--device" if getattr(args, "device", None) else "train.device =")


def apply_secret_file(cfg: Config, secret_file: str | None, hosts: Iterable[str]) -> Config:
    """`cfg` with runtime.secret_file set to `--secret-file`'s absolute path (if given), after
    checking that the secret the nodes will load is usable for `hosts` (the listen and join
    hosts involved). Raises UserError (one line) for a missing, unreadable, empty or weak secret,
    or for no secret with a non-loopback host, before any node process starts."""
    import dataclasses

    from gwtf.runtime import keys

    if secret_file:
        path = str(Path(secret_file).expanduser().absolute())
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, secret_file=path))
    keys.load_secret(cfg.runtime.secret_file or None, hosts=list(hosts))
    return cfg


def out_folder(text: str, flag: str = "--out") -> Path:
    """The output folder `text`, created if missing; UserError (one line) if it is an existing
    file or cannot be created."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {text} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {text}: cannot create the folder: {exc.strerror}") from None
    return path


def non_negative_s(value: float, flag: str) -> float:
    """A duration flag in seconds: finite and >= 0 (UserError naming the flag otherwise)."""
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{flag} must be a finite number of seconds >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # as given (`simulate --compiled` runs it again)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        sys.stderr.write(f"gwtf: error: {exc}\n")
        return 2
    except NothingToDo as exc:
        sys.stderr.write(f"gwtf: {exc}\n")
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("gwtf: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
