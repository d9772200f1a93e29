"""Lifecycle of `gwtf swarm` run as a user runs it (the CLI in a subprocess, loopback, 4 nodes).

One swarm (2 data holders, stages 1 and 2 with one replica each) on configs/swarm-test.toml:
- while it trains, each node prints progress lines (iteration, loss, members) on its stdout;
- kill -9 the only stage-1 relay: the launcher prints "stalled: stage 1 has no node" within a bound;
- freeze the stage-2 relay (SIGSTOP) past the eviction bound, then thaw it: the leader evicted it,
  so it stops itself, prints one line saying so and exits with code 3 (not 0), and the launcher
  reports the exit with its reason;
- SIGHUP the launcher (a closed terminal): it kills every node process and exits 128+1; no node
  survives it (each runs in its own session, so nothing else would stop them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from gwtf.config import load_config
from gwtf.runtime.status import read_jsonl, read_status

ROOT = Path(__file__).resolve().parents[2]
TEST_CONFIG = str(ROOT / "configs" / "swarm-test.toml")


def _wait(what: str, ok: Callable[[], bool], timeout_s: float, log: Path) -> float:
    """Poll `ok` until true; fail with the launcher's output at the deadline. Returns seconds waited."""
    start = time.monotonic()
    while not ok():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)  # polling period of a bounded wait
    return time.monotonic() - start


def _evicted(out: Path, name: str) -> bool:
    """Some node (the leader) recorded the eviction of `name`."""
    return any(row.get("event") == "evict" and str(row.get("node", "")).startswith(name + "~")  # NAME~FINGERPRINT/...
               for path in (out / "nodes").glob("*/records.jsonl") for row in read_jsonl(path))


def _pid(out: Path, name: str) -> int:
    status = read_status(out / "nodes" / name / "status.json") or {}
    return int(status["pid"])


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_stalled_stage_evicted_exit_code_and_sighup_cleanup(tmp_path: Path) -> None:
    cfg = load_config(TEST_CONFIG)
    out, log = tmp_path / "run", tmp_path / "launcher.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GWTF_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "gwtf", "swarm", "--config", TEST_CONFIG, "--out", str(out), "--replicas", "1",
           "--iterations", "100000", "--timeout-s", "600", "--set", 'protocol.router="greedy"']
    with log.open("wb") as sink:
        launcher = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    nodes: list[psutil.Process] = []
    try:
        _wait("swarm ready", lambda: "swarm of 4 nodes ready" in log.read_text(errors="replace"), 120, log)
        nodes = psutil.Process(launcher.pid).children(recursive=True)
        assert len(nodes) >= 4, [n.cmdline() for n in nodes]

        dh0_out = out / "nodes" / "dh0" / "stdout.log"
        _wait("a progress line", lambda: "progress: dh0 stage 0 iteration" in dh0_out.read_text(errors="replace"),
              60, log)
        line = next(x for x in dh0_out.read_text().splitlines() if x.startswith("progress: dh0"))
        assert " loss " in line and " members 4 " in line, line

        os.kill(_pid(out, "r1a"), signal.SIGKILL)
        took = _wait("stall reported", lambda: "stalled: stage 1 has no node" in log.read_text(errors="replace"),
                     10, log)
        assert took < 5.0
        _wait("kill reported", lambda: "node r1a was killed by SIGKILL" in log.read_text(errors="replace"), 10, log)

        r2a = psutil.Process(_pid(out, "r2a"))
        r2a.suspend()
        _wait("r2a evicted", lambda: _evicted(out, "r2a"), cfg.protocol.evict_after_s * 5, log)
        r2a.resume()
        r2a.wait(timeout=30)  # not our child: the launcher reaps it and reports its exit code
        _wait("exit reported", lambda: "node r2a exited with code 3: evicted" in log.read_text(errors="replace"),
              10, log)
        node_out = (out / "nodes" / "r2a" / "stdout.log").read_text(errors="replace")
        assert "gwtf node r2a: stopped: evicted" in node_out, node_out[-2000:]

        launcher.send_signal(signal.SIGHUP)
        assert launcher.wait(timeout=30) == 128 + signal.SIGHUP
        gone, alive = psutil.wait_procs(nodes, timeout=15)
        assert not alive, f"node processes survived SIGHUP: {[p.pid for p in alive]}"
        assert "stopped by SIGHUP" in log.read_text(errors="replace")
    finally:
        for p in [*nodes, psutil.Process(launcher.pid)] if launcher.poll() is None else nodes:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        launcher.wait(timeout=10)
