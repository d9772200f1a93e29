"""Every test in tests/ is run by some stage of `.ci/run` (issue 43): no marker can be deselected
everywhere again, as `slow` was (pyproject's addopts deselect it, and no stage selected it).

A stage is one pytest command of `.ci/run` (its `-m` expression, else addopts'; its paths, else
`testpaths`), plus `benchmarks/gpu_check.sh`, which runs the pytest command written in
benchmarks/gpu_check.py (`pytest -m gpu tests/gpu`) unless given `--skip-tests`. Two checks: every
marker registered in pyproject.toml alone is selected by some stage's expression (cheap, static),
and every collected test (one `--collect-only` subprocess, with its markers as pytest sees them)
lies under some stage's paths and matches its expression. The `-m` expressions are evaluated by
pytest's own expression parser.
"""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / ".ci" / "run"
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
# pytest options that take a value (as the next word); those that filter tests are refused below
VALUED = {"-m", "-k", "-p", "-o", "-c", "--timeout", "--durations", "--deselect", "--ignore", "--ignore-glob",
          "--rootdir", "--confcutdir", "-W"}
FILTERS = {"-k", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed", "--sw", "--stepwise"}
COLLECT = r'''
import json, sys
import pytest
class Recorder:
    items = []
    def pytest_collection_finish(self, session):
        Recorder.items = [[i.nodeid, sorted({m.name for m in i.iter_markers()})] for i in session.items]
rc = pytest.main(["--collect-only", "-q", "-m", "", *sys.argv[2:]], plugins=[Recorder()])
with open(sys.argv[1], "w") as f:
    json.dump({"rc": int(rc), "items": Recorder.items}, f)
'''


@dataclass(frozen=True, slots=True)
class Stage:
    name: str  # the command, for messages
    expr: str  # the -m expression in force ("" = every test)
    paths: tuple[str, ...]  # relative to the repository root

    def selects(self, markers: set[str]) -> bool:
        def has(name: str, /, **_: str | int | bool | None) -> bool:
            return name in markers

        return not self.expr or Expression.compile(self.expr).evaluate(has)

    def covers(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.paths)


def _pytest_ini() -> dict[str, Any]:
    ini: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]
    return ini["ini_options"]  # type: ignore[no-any-return]


def registered_markers() -> set[str]:
    return {str(line).split(":", 1)[0].strip() for line in _pytest_ini()["markers"]}


def _defaults() -> tuple[str, tuple[str, ...]]:
    """(addopts' -m expression, testpaths): what a stage without its own -m or paths runs."""
    ini = _pytest_ini()
    addopts = [str(a) for a in ini.get("addopts", [])]
    expr = addopts[addopts.index("-m") + 1] if "-m" in addopts else ""
    return expr, tuple(str(p) for p in ini.get("testpaths", ["."]))


def _stage(name: str, args: list[str]) -> Stage:
    """A stage from a pytest command's arguments (the words after `pytest`)."""
    default_expr, default_paths = _defaults()
    expr: str | None = None
    paths: list[str] = []
    words = iter(args)
    for word in words:
        option = word.split("=", 1)[0]
        if option in FILTERS:
            raise AssertionError(f"{name}: {option} filters tests; teach tests/unit/test_ci_markers.py about it")
        if option in VALUED:
            value = word.split("=", 1)[1] if "=" in word else next(words)
            if option == "-m":
                expr = value  # pytest keeps the last -m, so a stage's own replaces addopts'
        elif not word.startswith("-"):
            paths.append(word.split("::", 1)[0])
    return Stage(name, default_expr if expr is None else expr, tuple(paths) or default_paths)


def _gpu_check_args() -> list[str]:
    """The words after `pytest` in the command benchmarks/gpu_check.py runs."""
    for node in ast.walk(ast.parse(GPU_CHECK.read_text(encoding="utf-8"))):
        if isinstance(node, ast.List):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if "pytest" in words:
                return words[words.index("pytest") + 1:]
    raise AssertionError(f"no pytest command found in {GPU_CHECK}")


def ci_stages(script: str) -> list[Stage]:
    """Every stage of a `.ci/run` text: its pytest commands and the GPU check's."""
    stages = []
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word not in SHELL_OPERATORS:
                command.append(word)
                continue
            if "pytest" in command and command.index("pytest") > 0 and command[command.index("pytest") - 1] == "-m":
                stages.append(_stage(" ".join(command), command[command.index("pytest") + 1:]))
            elif any(w.endswith("benchmarks/gpu_check.sh") for w in command) and "--skip-tests" not in command:
                stages.append(_stage(" ".join(command), _gpu_check_args()))
            command = []
    return stages


def unrun_markers(stages: list[Stage], markers: set[str]) -> list[str]:
    """The registered markers that no stage selects on a test carrying only that marker."""
    return sorted(m for m in markers if not any(s.selects({m}) for s in stages))


def test_the_ci_stages_are_found() -> None:
    stages = ci_stages(CI.read_text(encoding="utf-8"))
    exprs = [s.expr for s in stages]
    assert len(stages) >= 4, stages  # default suite, GPU check, slow, integration
    assert _defaults()[0] in exprs  # the default suite: `pytest -q`, addopts' expression
    assert any(s.selects({"gpu"}) and s.paths == ("tests/gpu",) for s in stages), stages


def test_every_registered_marker_is_run_by_a_ci_stage() -> None:
    missing = unrun_markers(ci_stages(CI.read_text(encoding="utf-8")), registered_markers())
    assert not missing, (f"tests marked {missing} are deselected by every stage of .ci/run: add a bounded "
                         f"stage for them (like the integration one)")


def test_the_check_catches_a_dropped_stage() -> None:
    """Without its slow stage, .ci/run leaves `slow` unrun (the state before issue 43)."""
    script = "\n".join(line for line in CI.read_text(encoding="utf-8").splitlines()
                       if "pytest" not in line or "slow" not in line)
    assert unrun_markers(ci_stages(script), registered_markers()) == ["slow"]
    assert unrun_markers(ci_stages("python -m pytest -q\n"), registered_markers()) == ["gpu", "integration", "slow"]


def test_every_collected_test_is_run_by_a_ci_stage(tmp_path: Path) -> None:
    out = tmp_path / "items.json"
    proc = subprocess.run([sys.executable, "-c", COLLECT, str(out), "tests"], cwd=ROOT, capture_output=True,
                          text=True, timeout=100, check=False)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text(encoding="utf-8"))
    assert got["rc"] == 0 and len(got["items"]) > 500, proc.stdout[-2000:] + proc.stderr[-2000:]
    stages = ci_stages(CI.read_text(encoding="utf-8"))
    unrun: dict[tuple[str, ...], list[str]] = {}
    for nodeid, markers in got["items"]:
        path = nodeid.split("::", 1)[0]
        if not any(s.covers(path) and s.selects(set(markers)) for s in stages):
            unrun.setdefault(tuple(markers), []).append(nodeid)
    assert not unrun, "tests no stage of .ci/run runs:\n" + "\n".join(
        f"markers {list(k)}: {len(v)} tests, e.g. {v[:3]}" for k, v in unrun.items())


@pytest.mark.parametrize(("line", "expr", "paths"), [
    ('run_pytest timeout 900 python -m pytest -q -m "slow and not integration" tests/sim', "slow and not integration",
     ("tests/sim",)),
    ("echo x && python -m pytest -q --durations=0 -p no:randomly tests/a.py::test_b  # a comment", None,
     ("tests/a.py",)),
])
def test_a_stage_is_read_from_a_shell_line(line: str, expr: str | None, paths: tuple[str, ...]) -> None:
    (stage,) = ci_stages(line)
    assert stage.expr == (_defaults()[0] if expr is None else expr)
    assert stage.paths == paths
