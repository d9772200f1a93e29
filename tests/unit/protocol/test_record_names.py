"""Record names are `kinds.RecordName`: every record a driver waits for is one the core emits
(drive.py once waited for "done", "member_join" and "activate", which nothing emits), and the
names compared as plain strings elsewhere (the invariant checker, the fault generator) exist."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from gwtf.protocol.kinds import RecordName
from gwtf.runtime import drive

SRC = Path(__file__).resolve().parents[3] / "src" / "gwtf"


def _core_emits() -> set[str]:
    """Names the core passes to `record(RecordName.X, ...)` (or assigns from RecordName.X first)."""
    names: set[str] = set()
    for path in sorted((SRC / "protocol").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "RecordName" and path.name != "kinds.py":
                names.add(RecordName[node.attr].value)
    return names


def test_every_record_the_node_process_waits_for_is_emitted_by_the_core() -> None:
    emitted = _core_emits()
    for waited in (drive.DONE_EVENTS, drive.CRASH_EVENTS, drive.JOIN_EVENTS, drive.ACTIVE_EVENTS):
        assert waited <= emitted, f"no code emits {sorted(waited - emitted)}"


def test_record_names_compared_as_strings_exist() -> None:
    tree = ast.parse((SRC / "protocol" / "invariants.py").read_text(encoding="utf-8"))
    compared = {c.value for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Name) and node.left.id == "event"
                for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert compared, "the invariant checker compares no record names: this test reads the wrong code"
    sys.path.insert(0, str(SRC.parents[1] / "tests" / "sim"))
    from faultgen import TRIGGERS

    assert not (compared | set(TRIGGERS)) - {r.value for r in RecordName}


def test_record_names_keep_their_strings() -> None:
    """StrEnum: a member is its string (records.jsonl, metrics and audit names are contracts)."""
    for r in RecordName:
        assert r == r.value and hash(r) == hash(r.value) and f"{r}" == r.value
        assert r.name == r.value.upper()
