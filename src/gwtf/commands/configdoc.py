"""`docs/config.md` from the config dataclasses: every key with its meaning, unit, type and default.

Owns: reading each field's description from the source and rendering the document. The
description of a field is its comment, so documenting a key is writing the comment the project
already asks for (no registry to edit, nothing else to merge):

    seq_len: int = 128  # tokens per sequence (context length)

or, for a longer one, comment lines directly above the field. The unit comes from the name's
suffix (`_s`: seconds, `_bytes`, `_per_s`, `_per_hour`, `_fraction`), else "-" (a count or a plain
number, as the description says). `undocumented()` lists fields with no comment; a test fails on
them. Regenerate with `gwtf config --docs --out docs/config.md`.
Must not import torch, asyncio or socket (a helper of `gwtf config`, hence under commands/).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

from gwtf.config import Config, _type_name

REGENERATE = "gwtf config --docs --out docs/config.md"
UNITS = (("_bytes_per_s", "bytes/s"), ("_per_hour", "1/h"), ("_per_s", "1/s"), ("_bytes", "bytes"),
         ("_fraction", "fraction"), ("_s", "s"))


@dataclasses.dataclass(frozen=True, slots=True)
class FieldDoc:
    key: str  # "section.name"
    type: str
    default: str
    unit: str
    doc: str
    where: str  # file:line of the field


@cache
def _comments(path: str) -> dict[int, str]:
    """Line number -> comment text (without '#') of every comment in the file."""
    out: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for tok in tokenize.generate_tokens(io.StringIO(f.read()).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@cache
def _field_lines(cls: type) -> dict[str, tuple[int, int, str]]:
    """Field name -> (first line, last line, file) of its definition in the class body."""
    path = inspect.getsourcefile(cls)
    assert path is not None
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return {st.target.id: (st.lineno, st.end_lineno or st.lineno, path) for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    raise LookupError(f"class {cls.__name__} not found in {path}")


def _doc_of(cls: type, name: str) -> tuple[str, str]:
    first, last, path = _field_lines(cls)[name]
    comments = _comments(path)
    source = Path(path).read_text(encoding="utf-8").splitlines()
    trailing = [comments[n] for n in range(first, last + 1) if n in comments]
    above: list[str] = []
    n = first - 1
    while n in comments and source[n - 1].lstrip().startswith("#"):
        above.insert(0, comments[n])
        n -= 1
    return " ".join(above + trailing).strip(), f"{Path(path).name}:{first}"


def _unit(name: str) -> str:
    return next((unit for suffix, unit in UNITS if name.endswith(suffix)), "-")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    text = json.dumps(value) if isinstance(value, str) else repr(value)  # strings as TOML writes them
    return "`" + text.replace("|", "\\|") + "`"


def fields_of(cls: type, prefix: str) -> list[FieldDoc]:
    """The documented fields of dataclass `cls` under `prefix` (nested sections not included)."""
    import typing

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) or (typing.get_origin(tp) is tuple and typing.get_args(tp)
                                            and dataclasses.is_dataclass(typing.get_args(tp)[0])):
            continue  # a section of its own
        doc, where = _doc_of(cls, f.name)
        out.append(FieldDoc(key=f"{prefix}{f.name}", type=_type_name(tp).replace("|", "\\|"), default=_default(f),
                            unit=_unit(f.name), doc=doc, where=where))
    return out


def _sections(root: type) -> list[tuple[str, type]]:
    """(TOML table name, dataclass) of the root and each nested section, in field order."""
    import typing

    hints = typing.get_type_hints(root)
    out: list[tuple[str, type]] = [("", root)]
    for f in dataclasses.fields(root):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.append((f.name, tp))  # type: ignore[arg-type]
        elif typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out.append((f"[{f.name}]", typing.get_args(tp)[0]))  # an array of tables
    return out


def _trees() -> list[tuple[str, str, type]]:
    from gwtf.sim.scenario import ScenarioConfig

    return [("Run config", "`gwtf train`, `swarm`, `demo`, `node`, `data` (`--config FILE`, `--set section.key=value`)",
             Config),
            ("Simulator scenario", "`gwtf simulate SCENARIO.toml` (configs/scenarios/, `--set` likewise)",
             ScenarioConfig)]


def all_fields() -> list[FieldDoc]:
    out = []
    for _, _, root in _trees():
        for table, cls in _sections(root):
            out += fields_of(cls, f"{table.strip('[]')}." if table else "")
    return out


def undocumented() -> list[FieldDoc]:
    return [f for f in all_fields() if not f.doc]


def render() -> str:
    """The whole of docs/config.md."""
    lines = ["# Config keys", "",
             f"Generated from the dataclasses by `{REGENERATE}`; do not edit by hand.",
             "Layering: defaults < TOML file (`--config`) < `--set section.key=value`. Unknown keys, wrong",
             "types and out-of-range values are one-line errors (exit code 2). Unit \"-\": a count or a plain",
             "number (see the meaning); s = seconds.", ""]
    for title, used_by, root in _trees():
        lines += [f"## {title}", "", f"Used by {used_by}.", ""]
        for table, cls in _sections(root):
            fields = fields_of(cls, "")
            if not fields:
                continue
            name = table or "(top level)"
            lines += [f"### `[{name}]`" if table else f"### {name}", ""]
            lines += ["| key | meaning | unit | type | default |", "|---|---|---|---|---|"]
            lines += [f"| `{f.key}` | {_cell(f.doc)} | {f.unit} | {f.type} | {f.default} |" for f in fields]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
