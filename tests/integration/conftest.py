"""Integration-test plumbing: real node processes on loopback, bounded waits, always cleaned up.

Fixtures and helpers:
- `out_dir` + `reap_children`: every test's node processes are killed at teardown (the swarm's
  own `close`, then a psutil sweep of anything this pytest process still has as a child); the
  sweep fails the test if it had to kill something the swarm did not;
- `make_swarm(...)`: a `Swarm` on configs/swarm-test.toml with extra overrides, faults and slowed nodes;
- `finish(swarm, n, timeout_s)`: poll (never sleep to synchronise) until n iterations are
  complete, fail with every node's log tail at the deadline, then check the exactly-once ledger
  from the node logs (`gwtf.runtime.audit`) and return its totals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from gwtf.config import load_config
from gwtf.runtime.swarm import Swarm, SwarmOptions

ROOT = Path(__file__).resolve().parents[2]
TEST_CONFIG = str(ROOT / "configs" / "swarm-test.toml")


@pytest.fixture(autouse=True)
def reap_children() -> Iterator[None]:
    """After each test: no process started by this test may survive."""
    yield
    leftovers = psutil.Process().children(recursive=True)
    for child in leftovers:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    assert not leftovers, f"processes left running: {[p.pid for p in leftovers]}"


MakeSwarm = Callable[..., Swarm]


@pytest.fixture
def make_swarm(tmp_path: Path) -> Iterator[MakeSwarm]:
    swarms: list[Swarm] = []

    def make(overrides: tuple[str, ...] = (), replicas: int = 2, faults: dict[str, str] | None = None,
             name: str = "swarm", slowdowns: dict[str, float] | None = None) -> Swarm:
        cfg = load_config(TEST_CONFIG, list(overrides))
        opts = SwarmOptions(out_dir=tmp_path / name, replicas=replicas, config_path=TEST_CONFIG,
                            overrides=tuple(overrides), faults=dict(faults or {}),
                            slowdowns=dict(slowdowns or {}))
        swarm = Swarm(cfg, opts, say=lambda s: None)
        swarms.append(swarm)
        return swarm

    yield make
    for s in swarms:
        s.close()


Finish = Callable[[Swarm, int, float], dict[str, int]]


@pytest.fixture
def finish() -> Finish:
    def run(swarm: Swarm, iterations: int, timeout_s: float) -> dict[str, int]:
        if not swarm.run_until(iterations, timeout_s):
            pytest.fail(f"only {len(swarm.metrics.rows)}/{iterations} iterations in {timeout_s}s\n{swarm.log_tails()}")
        problems, totals = swarm.audit(iterations)
        assert not problems, "exactly-once violated:\n" + "\n".join(problems)
        return totals

    return run
