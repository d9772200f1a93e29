"""Every option and positional of every subcommand (nested ones included) has `--help` text."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from gwtf.cli import COMMANDS, build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "gwtf") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_has_help() -> None:
    missing = []
    seen = 0
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            seen += 1
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert seen > 50
    assert not missing, "options without help text (add help=...): " + ", ".join(missing)


def test_every_command_is_built() -> None:
    parser = build_parser()
    names = {p.split()[1] for p, _ in _parsers(parser) if len(p.split()) == 2}
    assert names == set(COMMANDS)
