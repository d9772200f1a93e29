"""`--resume` and the refusal to overwrite a previous run, through the real CLI: exit code 2 and
one stderr line naming the folder (no node process is started in any of these cases)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")


def _gwtf(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GWTF_CACHE": str(tmp_path / "cache"), "GWTF_PIP_INDEX_URL": "none"}
    return subprocess.run([sys.executable, "-m", "gwtf", *args, "--config", CONFIG], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path, check=False)


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_swarm_refuses_a_previous_run_without_resume(tmp_path: Path) -> None:
    (tmp_path / "run" / "nodes" / "dh0").mkdir(parents=True)
    _one_line_error(_gwtf(tmp_path, "swarm", "--out", "run"), "--out run is not empty", "--resume")
    assert (tmp_path / "run" / "nodes" / "dh0").is_dir()  # nothing was deleted


def test_swarm_resume_with_nothing_to_resume(tmp_path: Path) -> None:
    _one_line_error(_gwtf(tmp_path, "swarm", "--out", "empty", "--resume"), "nothing to resume from", "empty")
    (tmp_path / "run" / "nodes").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "stage0").mkdir(parents=True)
    _one_line_error(_gwtf(tmp_path, "swarm", "--out", "run", "--resume"), "nothing to resume from",
                    "checkpoints has no checkpoint complete for all 3 stages")


def test_node_refuses_its_previous_folder_and_resume_needs_a_checkpoint(tmp_path: Path) -> None:
    node = tmp_path / "run" / "nodes" / "dh0"
    node.mkdir(parents=True)
    (node / "records.jsonl").write_text("")
    _one_line_error(_gwtf(tmp_path, "node", "--out", "run", "--name", "dh0", "--role", "data-holder"),
                    "holds a previous run (node dh0)", "--resume")
    _one_line_error(_gwtf(tmp_path, "node", "--out", "run", "--name", "dh0", "--role", "data-holder", "--resume"),
                    "nothing to resume from")
