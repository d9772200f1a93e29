"""The simulator's compiled core: the same source, compiled with mypyc (`gwtf simulate --compiled`).

Owns: `HOT_MODULES` (what is compiled: the simulator's driver, the node core's parts and the
flow router), `build_key()` (a digest of every source file of the package, the interpreter and
the compiler: a build serves only the exact source it was built from), `ensure_build()` (a copy
of the package in the cache folder with the hot modules compiled in place, built once per key),
`missing_toolchain()` (what a build would lack), `active()` (whether this process runs the
compiled modules) and `reexec(argv)` (`gwtf simulate`
again, in a fresh interpreter with the build first on its path).

Why: a simulated event costs ~20 us of Python, spread thin over message dispatch, routing and the
engine (docs/simulator.md, "Where an event's time goes"); compiling the same modules takes
~1.5x off a run. Same source, same results: mypyc keeps Python's semantics (floats are the
same IEEE doubles, ints stay exact), so summary.json and timeline.csv are byte-identical with and
without it (tests/sim/test_compiled.py checks both systems on a churn scenario). Nothing else
changes: the pure-Python source stays the one the tests, the runtime and the docs use; a build
needs mypy (the test extra ships mypyc) and a C compiler, and takes ~2 minutes, once per source.

The cache folder is `$GWTF_CACHE_DIR`, else `$XDG_CACHE_HOME/gwtf`, else `~/.cache/gwtf`; builds
live in `compiled/KEY/` (the two newest kept).

Must not import torch.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import gwtf
from gwtf.errors import UserError

__all__ = ["ENV_KEY", "HOT_MODULES", "active", "build_key", "cache_dir", "ensure_build", "missing_toolchain", "reexec"]

HOT_MODULES: tuple[str, ...] = (
    "sim/engine.py", "sim/models.py", "sim/simulator.py",
    "protocol/routing/agent.py", "protocol/routing/anneal.py", "protocol/routing/moves.py",
    "protocol/routing/reserve.py", "protocol/routing/state.py", "protocol/view.py", "protocol/simple_router.py",
    "protocol/training.py", "protocol/ledger.py", "protocol/membership.py", "protocol/aggregation.py",
    "protocol/leader.py", "protocol/core.py", "protocol/rebalance.py", "protocol/swarm.py", "protocol/butterfly.py",
)
"""Package-relative paths. Messages and effects (`protocol.messages`, `protocol.base`) stay
Python classes: their registry and fast constructors rely on it."""

ENV_KEY = "GWTF_COMPILED"  # set for the re-executed process: the key of the build it must run
BUILD_TIMEOUT_S = 1800.0
KEEP_BUILDS = 2
_MARKER = "BUILT"


def package_dir() -> Path:
    return Path(gwtf.__file__).resolve().parent


def cache_dir() -> Path:
    if os.environ.get("GWTF_CACHE_DIR"):
        return Path(os.environ["GWTF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gwtf"


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _mypy_version() -> str:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return ""


def build_key(root: Path | None = None) -> str:
    """Digest of the interpreter, mypy's version, the module list and every .py file of the
    package (its path and bytes): a change to any source file means a new build."""
    root = root or package_dir()
    h = hashlib.sha256()
    for part in (sys.version, sys.platform, _mypy_version(), *HOT_MODULES):
        h.update(part.encode() + b"\0")
    for p in _sources(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:20]


def active() -> bool:
    """This process runs the compiled node core (an extension module, not core.py)."""
    import gwtf.protocol.core as core

    return any(str(core.__file__).endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)


def missing_toolchain() -> str:
    """What this machine lacks to build the compiled core, as `--compiled`'s error says it; ""
    when nothing is missing."""
    if importlib.util.find_spec("mypyc") is None:
        return "--compiled needs mypyc, which ships with mypy: pip install mypy (or gwtf's test extra)"
    if importlib.util.find_spec("setuptools") is None:  # mypyc builds its extension through it
        return "--compiled needs setuptools (mypyc builds with it): pip install setuptools"
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"--compiled needs a C compiler: {cc!r} is not on PATH"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "--compiled needs the Python headers (Python.h; e.g. the python3.11-dev package)"
    return ""


def ensure_build() -> Path:
    """The build folder for this source (built now if missing): put it first on PYTHONPATH."""
    key = build_key()
    root = cache_dir() / "compiled"
    dest = root / key
    if (dest / _MARKER).exists():
        return dest
    missing = missing_toolchain()
    if missing:
        raise UserError(missing)
    work = root / f"{key}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(package_dir(), work / "gwtf", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    except OSError as exc:
        raise UserError(f"--compiled: cannot write the build folder {root} ({exc.strerror or exc}); "
                        f"set GWTF_CACHE_DIR to a writable folder") from None
    log = root / f"{key}.build.log"
    print(f"gwtf: compiling the simulator core with mypyc (once for this source, about 2 minutes; "
          f"log {log})", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "mypyc", *(f"gwtf/{m}" for m in HOT_MODULES)]
    with open(log, "w", encoding="utf-8") as fh:
        try:
            rc = subprocess.run(cmd, cwd=work, stdout=fh, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise UserError(f"--compiled: the mypyc build failed (exit {rc}); its log: {log}")
    shutil.rmtree(work / "build", ignore_errors=True)  # the generated C and object files
    if build_key(work / "gwtf") != key:
        shutil.rmtree(work, ignore_errors=True)
        raise UserError("--compiled: the package's source changed during the build; run it again")
    (work / _MARKER).write_text(key + "\n", encoding="utf-8")
    try:
        os.replace(work, dest)
    except OSError:  # another process finished the same build first
        shutil.rmtree(work, ignore_errors=True)
    log.unlink(missing_ok=True)
    _prune(root, keep=dest)
    return dest


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the newest KEEP_BUILDS finished builds (and `keep`)."""
    builds = sorted((p for p in root.iterdir() if (p / _MARKER).exists() and p != keep),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[KEEP_BUILDS - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def reexec(argv: Sequence[str]) -> None:
    """Run `python -m gwtf ARGV` in this process's place, on the compiled build (does not return).
    A process already re-executed that still runs Python source is refused (no loop)."""
    if os.environ.get(ENV_KEY):
        raise UserError(f"--compiled: the build {os.environ[ENV_KEY]} did not load "
                        f"(gwtf.protocol.core is {sys.modules['gwtf.protocol.core'].__file__})")
    dest = ensure_build()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(dest), *filter(None, [env.get("PYTHONPATH", "")])])
    env[ENV_KEY] = dest.name
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "gwtf", *argv], env)
