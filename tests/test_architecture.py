"""Fitness tests: the layer rules of DESIGN.md section 2, checked by parsing every module's imports.

Pure packages (`flow`, `protocol`, `sim`, plus `config`, `errors`, and the pure model modules
`model.presets`, `model.partition`) must not import torch, asyncio, socket, threading or time.
Only `runtime` may import asyncio/socket. The simulator must not import the runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gwtf"
IO_AND_TORCH = {"torch", "asyncio", "socket", "threading", "time", "selectors", "subprocess", "multiprocessing"}
PURE_PACKAGES = ("flow", "protocol", "sim")
PURE_MODULES = ("config.py", "errors.py", "model/presets.py", "model/partition.py")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _pure_files() -> list[Path]:
    files = [p for pkg in PURE_PACKAGES for p in sorted((SRC / pkg).rglob("*.py"))]
    files += [SRC / m for m in PURE_MODULES if (SRC / m).exists()]
    return files


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_pure_modules_import_no_io_or_torch(path: Path) -> None:
    """A pure module imports none of torch/asyncio/socket/threading/time, nor gwtf.runtime."""
    bad = {n for n in _imports(path) if _top(n) in IO_AND_TORCH}
    bad |= {n for n in _imports(path) if n.startswith("gwtf.runtime")}
    impure_model = {
        n for n in _imports(path)
        if n.startswith("gwtf.model") and n not in ("gwtf.model", "gwtf.model.presets", "gwtf.model.partition")
    }
    assert not bad and not impure_model, f"{path.relative_to(SRC)} imports {sorted(bad | impure_model)}"


def test_only_runtime_imports_asyncio_and_socket() -> None:
    """asyncio and socket appear only under gwtf/runtime (and the commands that start it)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("runtime", "commands"):
            continue
        if {_top(n) for n in _imports(path)} & {"asyncio", "socket"}:
            offenders.append(str(rel))
    assert not offenders, offenders


def test_architecture_rules_see_modules() -> None:
    """Guard against the check silently passing because it found nothing to check."""
    assert len(_pure_files()) >= 3
