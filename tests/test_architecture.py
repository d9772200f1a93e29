"""Fitness tests: the layering table of docs/architecture.md, checked by parsing every module's imports.

The table is read from the document itself, so the rules and their enforcement cannot drift: every
module of `src/gwtf` belongs to exactly one row; each of its imports must be allowed by the row's
"may import" column and must not be named by its "must not import" column. The pure rows (flow,
protocol, sim, config, errors, model.presets, model.partition) also import no process, thread or
clock module at all.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "gwtf"
DOC = ROOT / "docs" / "architecture.md"
PURE = ("flow", "protocol", "sim", "config", "errors", "ids", "model.presets", "model.partition")
NO_IO = {"torch", "asyncio", "socket", "threading", "time", "selectors", "subprocess", "multiprocessing"}


@dataclass(frozen=True)
class Row:
    names: tuple[str, ...]  # the packages/modules of this row ("model" of "`model` (rest)")
    may: tuple[str, ...] | None  # None: everything ...
    may_not: tuple[str, ...]  # ... but these


def _cell(text: str) -> tuple[str, ...]:
    return tuple(t.strip().strip("`") for t in text.split(",") if t.strip() and t.strip() != "-")


def _table() -> list[Row]:
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = tuple(re.findall(r"`([^`]+)`", cells[0]))
        may = cells[2]
        if may.startswith("everything"):
            rest = may.removeprefix("everything").strip().removeprefix("but").strip()
            rows.append(Row(names, None, _cell(rest) + _cell(cells[3])))
        else:
            rows.append(Row(names, _cell(may), _cell(cells[3])))
    return rows


ROWS = _table()


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or "gwtf"


def _row_of(module: str) -> Row:
    """The most specific row naming the module or a package above it."""
    best: tuple[int, Row] | None = None
    for row in ROWS:
        for name in row.names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[0]:
                    best = (len(name), row)
    assert best is not None, f"gwtf.{module} belongs to no row of docs/architecture.md"
    return best[1]


def _imports(path: Path) -> set[str]:
    """Imported names as the table spells them: 'stdlib', a gwtf module path, or a top-level package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if name == "gwtf" or top == "__future__":
                continue
            if top == "gwtf":
                out.add(name.removeprefix("gwtf."))
            else:
                out.add(top)
    return out


def _matches(imported: str, entry: str) -> bool:
    top = imported.split(".")[0]
    if entry == "stdlib":
        return top in sys.stdlib_module_names and top not in _GWTF_TOPS
    if entry == "gwtf":
        return top in _GWTF_TOPS
    return imported == entry or imported.startswith(entry + ".")


_GWTF_TOPS = frozenset(p.name.removesuffix(".py") for p in SRC.iterdir() if not p.name.startswith("_"))


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_keeps_its_rows_rules(path: Path) -> None:
    module = _module_name(path)
    if module == "gwtf":  # the package's own __init__
        return
    row = _row_of(module)
    own = next(n for n in row.names if module == n or module.startswith(n + "."))
    imports = _imports(path)
    forbidden = {i for i in imports if any(_matches(i, e) for e in row.may_not)}
    if row.may is not None:
        forbidden |= {i for i in imports if not _matches(i, own) and not any(_matches(i, e) for e in row.may)}
    if any(module == p or module.startswith(p + ".") for p in PURE):
        forbidden |= {i for i in imports if i.split(".")[0] in NO_IO}
    assert not forbidden, f"gwtf.{module} imports {sorted(forbidden)} against docs/architecture.md"


def test_the_table_is_read_and_covers_the_packages() -> None:
    """Guard against the check silently passing because it found no rules."""
    names = {n for r in ROWS for n in r.names}
    assert {"protocol", "protocol.routing", "protocol.base", "sim", "runtime", "flow", "model", "config", "tensor_sim", "commands"} <= names, names
    assert len(_modules()) > 50


def test_the_check_catches_a_violation(tmp_path: Path) -> None:
    """A protocol module importing torch or the runtime fails the rule (the check can fail)."""
    row = _row_of("protocol.core")
    for bad in ("torch", "runtime.transport", "sim.engine", "model.stage"):
        assert any(_matches(bad, e) for e in row.may_not) or not any(_matches(bad, e) for e in row.may or ()), bad
    assert any(_matches("sim", e) for e in _row_of("runtime.node").may_not)
    # the routing agent sees the protocol only through its vocabulary, never a core part
    assert any(_matches("protocol.core", e) for e in _row_of("protocol.routing.agent").may_not)
    assert not any(_matches("protocol.membership", e) for e in _row_of("protocol.routing.state").may or ())
    assert _matches("dataclasses", "stdlib") and not _matches("numpy", "stdlib")


def test_no_cycle_between_the_rows() -> None:
    """The rows' import graph is acyclic (a row's modules may import each other): e.g. `flow`
    names nodes through `ids`, so `flow` and `protocol` do not import each other."""
    rows = {id(r): r for r in ROWS}
    edges: dict[int, set[int]] = {k: set() for k in rows}
    for path in _modules():
        module = _module_name(path)
        if module == "gwtf":
            continue
        src = id(_row_of(module))
        for imported in _imports(path):
            if imported.split(".")[0] in _GWTF_TOPS:
                edges[src].add(id(_row_of(imported)))
    seen: dict[int, int] = {}  # 1: on the stack, 2: done

    def visit(k: int, trail: list[str]) -> None:
        seen[k] = 1
        for j in sorted(edges[k] - {k}):
            names = "/".join(rows[j].names)
            assert seen.get(j) != 1, f"import cycle: {' -> '.join([*trail, names])}"
            if j not in seen:
                visit(j, [*trail, names])
        seen[k] = 2

    for k in rows:
        if k not in seen:
            visit(k, ["/".join(rows[k].names)])


def test_test_file_names_are_unique() -> None:
    """The test folders are not packages: two test files with one name break collection of the
    whole default suite ('import file mismatch'; a merge once put test_measured_compute.py in
    tests/unit/protocol and tests/integration)."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


_SIBLING_REACH = re.compile(r"getattr\(self\b|type: ignore\[[^\]]*attr-defined")


def test_core_parts_reach_each_other_only_through_declared_interfaces() -> None:
    """No protocol file reaches a sibling part's attributes by `getattr(self, ...)` or hides a
    missing attribute with `type: ignore[attr-defined]`: what one part needs of another is
    declared: the parts are typed attributes of the node (issue 15)."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((SRC / "protocol").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if _SIBLING_REACH.search(line)]
    assert not hits, hits


def test_node_core_is_composed_of_parts_not_mixins() -> None:
    """NodeCore's parts (membership, data plane, aggregation, coordinator) are objects it holds
    (`NodeCore.PARTS`), each a plain class that owns its state and reaches the rest of the node
    through a typed reference; NodeCore derives only from CoreState (the node's shared facts),
    and every system's core class from NodeCore (issue 15)."""
    from gwtf.config import ProtocolConfig
    from gwtf.protocol.core import NodeCore
    from gwtf.protocol.ledger import CoreState
    from gwtf.protocol.systems import SYSTEMS

    assert NodeCore.__bases__ == (CoreState,)
    assert set(NodeCore.PARTS) == {"members", "plane", "agg", "coord"}
    for name, part in NodeCore.PARTS.items():
        assert part.__mro__ == (part, object), name
        assert name in CoreState.__annotations__, name  # declared, typed, on the shared state
    for system, factory in SYSTEMS.items():
        for rebalance_period_s in (0.0, 60.0):
            core = factory(ProtocolConfig(rebalance_period_s=rebalance_period_s)).core
            assert isinstance(core, type) and issubclass(core, NodeCore), system
            assert core.__mro__ in (NodeCore.__mro__, (core, *NodeCore.__mro__)), system  # at most one hook layer
            assert NodeCore.PARTS.items() <= core.PARTS.items(), system
            for name, part in core.PARTS.items():
                assert part.__mro__ == (part, object), (system, name)


