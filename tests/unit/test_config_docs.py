"""docs/config.md is generated from the config dataclasses and kept in sync; every key is documented."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cli_errors import gwtf
from gwtf.commands.configdoc import REGENERATE, all_fields, fields_of, render, undocumented
from gwtf.config import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_every_config_key_is_documented() -> None:
    missing = [f"{f.key} ({f.where})" for f in undocumented()]
    assert not missing, (
        "config keys without a description: " + ", ".join(missing) + ". Document each with a comment at the "
        "end of its line, e.g. `timeout_s: float = 5.0  # what it bounds (0 = off)`, or comment lines directly "
        f"above it (unit from the name: _s, _bytes, _per_s), then run `{REGENERATE}`"
    )


def test_docs_config_md_is_in_sync() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/config.md is stale: run `{REGENERATE}`"


def test_every_run_config_key_is_in_the_doc_with_its_default() -> None:
    assert len(all_fields()) > 150
    for section in dataclasses.fields(Config):
        cls = type(getattr(Config(), section.name))
        docs = {d.key: d for d in fields_of(cls, "")}
        for f in dataclasses.fields(cls):
            doc = docs[f.name]
            assert doc.default.strip("`") in (repr(f.default), f'"{f.default}"'), doc
    text = render()
    assert "| `connect_timeout_s` | TCP connect + swarm-secret handshake | s | float | `5.0` |" in text


def test_gwtf_config_docs_writes_the_file(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "config", "--docs", "--out", "config.md")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "config.md").read_text(encoding="utf-8") == render()
