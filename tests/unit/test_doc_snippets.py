"""The `gwtf ...` commands in README.md and docs/multi-host.md match the CLI: every subcommand
exists, every `--flag` is one of that subcommand's options, and every command line of a fenced
```bash block parses as written (argparse: choices, types, required options) unless it elides
flags with "..."."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from gwtf.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/multi-host.md")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _fenced_commands(text: str) -> list[str]:
    """Command lines of ```bash blocks that run gwtf (continuation lines joined, comments cut)."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("gwtf "):
                    out.append(part)
    return out


def _all_snippets(text: str) -> list[str]:
    """Every `gwtf SUBCOMMAND ...` mention: fenced or indented code lines and inline `code`."""
    spans = [s.replace("\\|", "|") for s in re.findall(r"`([^`\n]+)`", text)]
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.startswith("    gwtf ")]
    found = []
    for s in spans + lines + _fenced_commands(text):
        for m in re.finditer(r"(?:^|[\s(&])(gwtf [a-z]+.*)", s):
            found.append(m.group(1).split(" #", 1)[0].split("&&", 1)[0].strip())
    return found


def _doc_text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_in_the_docs_exists(doc: str) -> None:
    subs = _subparsers(build_parser())
    problems, checked = [], 0
    for snippet in _all_snippets(_doc_text(doc)):
        words = snippet.split()
        name = words[1]
        if name not in subs:
            problems.append(f"{snippet!r}: no command {name!r}")
            continue
        parser = subs[name]
        nested = _subparsers(parser)
        if len(words) > 2 and words[2] in nested:
            parser = nested[words[2]]
        known = set(parser._option_string_actions)
        for flag in FLAG.findall(snippet):
            checked += 1
            if flag not in known:
                problems.append(f"{snippet!r}: gwtf {name} has no option {flag}")
    assert checked > 10 if doc == "README.md" else checked > 0
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_fenced_commands_parse_as_written(doc: str) -> None:
    commands = _fenced_commands(_doc_text(doc))
    assert commands
    parser = build_parser()
    for command in (c for c in commands if "..." not in c):  # "..." elides flags on purpose
        try:
            args = parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            pytest.fail(f"{doc}: `{command}` does not parse")
        assert getattr(args, "_run", None), command


def test_multi_host_snippet_uses_reachable_addresses() -> None:
    """README's several-machines commands listen on a concrete address others can reach."""
    commands = [c for c in _fenced_commands(_doc_text("README.md")) if c.startswith("gwtf node")]
    assert len(commands) >= 2
    parser = build_parser()
    for command in commands:
        args = parser.parse_args(shlex.split(command)[1:])
        host = args.listen.rpartition(":")[0]
        assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", host) and host != "0.0.0.0", command
        assert args.join is None or args.join in {c.split("--listen ")[1].split()[0] for c in commands}, command
        assert args.name, f"{command}: name the node (a data holder's shard comes from its name)"
