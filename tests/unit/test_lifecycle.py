"""Launcher lifecycle pieces that need no node process: stalled stages in the live table, which
joiners count as joins (only the ones that served), and the refusal of a non-empty `--out`
(through the real CLI: one stderr line, exit 2; the demo replaces only its own earlier outputs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from gwtf.runtime.status import render_table, stalled_stages
from gwtf.runtime.swarm import served


def _gwtf(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GWTF_CACHE": str(cwd / "cache"), "GWTF_PIP_INDEX_URL": "none"}
    return subprocess.run([sys.executable, "-m", "gwtf", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd, check=False)


def test_a_stage_without_an_active_node_is_stalled_and_shown() -> None:
    rows = [
        {"name": "dh0", "stage": 0, "state": "active", "microbatches": 17},
        {"name": "r1a", "stage": 1, "state": "crashed"},  # its last status said active: dead now
        {"name": "r1b", "stage": 1, "state": "evicted"},
        {"name": "j1", "stage": 1, "state": "joining"},  # not serving yet
        {"name": "r2a", "stage": 2, "state": "active", "microbatches": 9},
    ]
    assert stalled_stages(rows, 3) == [1]
    assert stalled_stages(rows[:1], 3) == [1, 2]
    assert stalled_stages([*rows, {"name": "j1", "stage": 1, "state": "active"}], 3) == []
    console = Console(record=True, width=200)
    console.print(render_table(rows, "swarm", stalled_stages(rows, 3)))
    text = console.export_text()
    assert "stalled: stage 1 has no node" in text and "stage 2 has no node" not in text
    assert "served" in text and "17" in text and "evicted" in text


def test_only_a_joiner_that_served_after_activation_counts() -> None:
    joined = [{"event": "join_start"}, {"event": "join_stage", "stage": 1}, {"event": "state_imported"}]
    assert not served(joined)
    assert not served([*joined, {"event": "contribute"}, {"event": "activated"}])  # work before activation
    assert not served([*joined, {"event": "activated"}, {"event": "self_stop", "reason": "evicted"}])
    assert served([*joined, {"event": "activated"}, {"event": "contribute", "mb": [0, 4, 1]}])


def test_swarm_refuses_a_non_empty_out(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "old"
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    proc = _gwtf(tmp_path, "swarm", "--out", str(out), "--iterations", "2")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"--out {out} is not empty" in lines[0] and "--resume" in lines[0]
    assert (out / "metrics.jsonl").read_text() == "{}\n"  # untouched


def test_demo_refuses_a_foreign_folder_but_replaces_its_own(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    proc = _gwtf(tmp_path, "demo", "--out", str(mine))
    assert proc.returncode == 2 and "is not empty" in proc.stderr, proc.stderr
    foreign = tmp_path / "runs" / "demo"  # the default folder, but not a demo's outputs
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("keep")
    proc = _gwtf(tmp_path, "demo")
    assert proc.returncode == 2 and "is not empty" in proc.stderr, proc.stderr
    assert (foreign / "notes.txt").read_text() == "keep" and (mine / "notes.txt").read_text() == "keep"
    # an earlier demo's outputs in the default folder are replaced; a bad override is reported first
    (foreign / "notes.txt").unlink()
    (foreign / "demo.toml").write_text("# an earlier demo\n")
    (foreign / "metrics.jsonl").write_text("{}\n")
    proc = _gwtf(tmp_path, "demo", "--set", "train.no_such_key=1")
    assert proc.returncode == 2 and "train.no_such_key" in proc.stderr, proc.stderr
    assert (foreign / "metrics.jsonl").exists()  # nothing deleted for a run that cannot start
    # (a node that cannot start ends the run at once, after the folder was replaced)
    proc = _gwtf(tmp_path, "demo", "--set", 'runtime.fault="explode"')
    assert "replacing the earlier demo's outputs" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 2 and "swarm did not start" in proc.stderr, proc.stderr
    assert (foreign / "demo.toml").read_text().startswith("# gwtf demo: embedded defaults")
    assert (foreign / "metrics.jsonl").read_text() == ""  # the earlier run's rows are gone
