"""`gwtf demo`'s churn kills a data holder and a joiner takes its shard (issue 42): the real CLI in
a subprocess, on configs/swarm-test.toml with the demo's timeouts and the churn tests' iteration
time (`test_churn.DEMO_TIMEOUTS`, `DEMO_SHAPE`), 40 iterations, the default `--churn low` (one
kill). Its lines say which data holder died and which joiner replaced it, and the run ends clean
(the ledger audit of `gwtf swarm`'s loop). Bounded (`--timeout-s`, the subprocess timeout)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_churn import DEMO_SHAPE, DEMO_TIMEOUTS

from conftest import TEST_CONFIG

ITERATIONS = 40


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_demo_kills_a_data_holder_and_a_joiner_replaces_it(tmp_path: Path) -> None:
    sets = [arg for kv in (*DEMO_TIMEOUTS, *DEMO_SHAPE) for arg in ("--set", kv)]
    proc = subprocess.run(
        [sys.executable, "-m", "gwtf", "demo", "--config", TEST_CONFIG, *sets, "--iterations", str(ITERATIONS),
         "--timeout-s", "180", "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=220, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    killed = re.findall(r"^churn: kill -9 (dh[01]) \(data holder(?:, the leader)?\)$", proc.stderr, re.M)
    assert len(killed) == 1, text
    assert re.search(r"^churn: joiner j1 replaced a data holder \(from iteration \d+\)$",
                     proc.stderr, re.M), text
    assert re.search(rf"^done: {ITERATIONS} iterations, .*, crashes 1, joins 1 \(joiners that served, of 1 "
                     rf"started\), data holders killed 1 \({killed[0]}\), replaced 1 \(j1\); ", proc.stdout, re.M), text
