"""Shared helper of the user-error tests: run the real CLI in a subprocess and check that a
mistake ends as the project promises (exit code 2, exactly one non-empty stderr line naming
the problem, no traceback).

Import it as `from cli_errors import gwtf, assert_one_line_error` (tests/ is on sys.path through
its conftest). Each run gets a private cache and no package index (no download is ever tried).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def gwtf(cwd: Path, *args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    """`python -m gwtf ARGS` in `cwd` with GWTF_CACHE=cwd/cache and no pip index."""
    full_env = {**os.environ, "GWTF_CACHE": str(cwd / "cache"), "GWTF_PIP_INDEX_URL": "none", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gwtf", *args], capture_output=True, text=True, timeout=timeout_s,
        env=full_env, cwd=cwd, check=False,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit code 2, one non-empty stderr line (containing every needle), no traceback; returns the line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, f"exit code {proc.returncode}:\n{proc.stderr}"
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{proc.stderr}"
    assert lines[0].startswith("gwtf: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def gwtf_in_process(cwd: Path, *args: str) -> tuple[int, str]:
    """`gwtf.cli.main(ARGS)` in this process with cwd and GWTF_CACHE as `gwtf` sets them: (exit
    code, stderr). For the many variants of one mistake; each mistake also has a subprocess test."""
    import contextlib
    import io

    from gwtf.cli import main

    err = io.StringIO()
    old_cwd, old_cache = Path.cwd(), os.environ.get("GWTF_CACHE")
    os.chdir(cwd)
    os.environ["GWTF_CACHE"] = str(cwd / "cache")
    try:
        with contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse usage errors
                code = int(exc.code or 0)
    finally:
        os.chdir(old_cwd)
        if old_cache is None:
            os.environ.pop("GWTF_CACHE", None)
        else:
            os.environ["GWTF_CACHE"] = old_cache
    return code, err.getvalue()


def assert_one_line_error_in_process(result: tuple[int, str], *needles: str) -> str:
    """`assert_one_line_error` for `gwtf_in_process`'s result."""
    code, stderr = result
    return assert_one_line_error(subprocess.CompletedProcess([], code, "", stderr), *needles)
