"""The compiled simulator core (`gwtf simulate --compiled`, `gwtf.commands.compiled`).

- A build serves only the source it was built from: the key changes with any file's bytes, a
  new file or a renamed one (cheap, default suite).
- Without a toolchain the flag ends in one line and exit 2 (default suite).
- The compiled run equals the Python one byte for byte: summary.json and timeline.csv of both
  systems on a churn scenario whose crashes exercise recovery (slow: a build takes ~2 minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gwtf.commands import compiled

ROOT = Path(__file__).resolve().parents[2]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_the_build_key_follows_every_source_file(tmp_path: Path) -> None:
    _write(tmp_path, {"a.py": "x = 1\n", "sub/b.py": "y = 2\n"})
    key = compiled.build_key(tmp_path)
    assert compiled.build_key(tmp_path) == key  # deterministic
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("not source", encoding="utf-8")
    assert compiled.build_key(tmp_path) == key  # only .py sources count
    _write(tmp_path, {"sub/b.py": "y = 3\n"})
    changed = compiled.build_key(tmp_path)
    assert changed != key
    _write(tmp_path, {"c.py": ""})
    assert compiled.build_key(tmp_path) != changed
    (tmp_path / "c.py").rename(tmp_path / "d.py")
    assert len({key, changed, compiled.build_key(tmp_path)}) == 3


def test_the_package_key_is_the_copy_key(tmp_path: Path) -> None:
    """The re-executed process runs a copy of the package: the copy has the same key."""
    shutil.copytree(compiled.package_dir(), tmp_path / "gwtf", ignore=shutil.ignore_patterns("__pycache__"))
    assert compiled.build_key(tmp_path / "gwtf") == compiled.build_key()


def test_compiled_without_mypyc_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A toolchain that cannot build: one line naming what is missing, exit 2, no traceback."""
    env = dict(os.environ, GWTF_CACHE_DIR=str(tmp_path / "cache"), PATH=str(tmp_path / "empty"), CC="no-such-cc")
    (tmp_path / "empty").mkdir()
    out = subprocess.run([sys.executable, "-m", "gwtf", "simulate", "configs/scenarios/smoke.toml", "--compiled",
                          "--no-progress", "--out", str(tmp_path / "o")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gwtf: error: --compiled needs"), out.stderr
    assert not (tmp_path / "o").exists()


SCENARIO = ["configs/scenarios/paper-gpt-high.toml", "--seed", "4242", "--set", "train.iterations=10",
            "--set", "churn.crash_rate_per_hour=15.0", "--no-progress"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(bool(compiled.missing_toolchain()), reason=compiled.missing_toolchain() or "toolchain present")
def test_a_compiled_run_equals_the_python_run_byte_for_byte(tmp_path: Path) -> None:
    env = dict(os.environ, GWTF_CACHE_DIR=str(tmp_path / "cache"), MPLBACKEND="Agg")
    env.pop(compiled.ENV_KEY, None)
    runs = {}
    for name, extra in (("python", []), ("compiled", ["--compiled"])):
        out = subprocess.run([sys.executable, "-m", "gwtf", "simulate", *SCENARIO, "--out", str(tmp_path / name),
                              *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = out
    assert "compiled core" in runs["compiled"].stderr and "compiled core" not in runs["python"].stderr
    builds = [p for p in (tmp_path / "cache" / "compiled").iterdir() if p.is_dir()]
    assert len(builds) == 1 and (builds[0] / "BUILT").exists()
    assert list((builds[0] / "gwtf" / "protocol").glob("core.*.so"))  # the core is an extension module
    for f in ("summary.json", "timeline.csv"):
        assert (tmp_path / "compiled" / f).read_bytes() == (tmp_path / "python" / f).read_bytes(), f
    summary = json.loads((tmp_path / "python" / "summary.json").read_text(encoding="utf-8"))
    assert set(summary) == {"gwtf", "swarm"}
    assert all(s["crashes"] > 0 and s["finished"] for s in summary.values())  # recovery ran, both systems
    again = subprocess.run([sys.executable, "-m", "gwtf", "simulate", "configs/scenarios/smoke.toml", "--compiled",
                            "--no-progress", "--out", str(tmp_path / "again")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "compiling" not in again.stderr, again.stderr  # built once per source
