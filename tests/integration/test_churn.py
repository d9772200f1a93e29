"""Churn in real node processes, with the short timeouts of configs/swarm-demo.toml (a kill -9 is
noticed within ~2 s): every run must finish, every joiner must serve, the ledger (and the
simulator's invariant checker replayed over the node records: exactly once, identical steps, one
leader per term) must be clean.

Cases: `--churn high` (a relay killed and a joiner started every 8 of 40 iterations) on 5 seeds;
two joiners at once; the leader and a relay killed at once (an election under load); both
replicas of a stage killed, a joiner arriving later restores the stage from the checkpoint; the
state source of a joiner killed as it exports the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TEST_CONFIG
from gwtf.config import load_config
from gwtf.runtime.launcher import NodeProcess
from gwtf.runtime.swarm import Swarm, SwarmOptions

# configs/swarm-demo.toml's failure detection (heartbeat 0.25 s, evict after 1.5 s) on the test model
DEMO_TIMEOUTS = ("protocol.heartbeat_period_s=0.25", "protocol.suspect_after_s=0.75", "protocol.evict_after_s=1.5",
                 "protocol.deadline_multiplier=4.0", "protocol.deadline_floor_s=1.0",
                 "protocol.mb_deadline_floor_s=20.0", "protocol.retry_period_s=0.2",
                 "protocol.partition_timeout_s=30.0", "protocol.checkpoint_every=5")

# the demo's microbatch shape (4 microbatches of 4 x 64 tokens per data holder): an iteration takes
# about as long as in `gwtf demo`, so a joiner (a new process: ~2-3 s to import torch and join)
# has the time the demo gives it
DEMO_SHAPE = ("model.seq_len=64", "model.microbatch_size=4", "train.microbatches=4")


def _swarm(tmp_path: Path, overrides: tuple[str, ...], churn: str = "none",
           faults: dict[str, str] | None = None) -> Swarm:
    cfg = load_config(TEST_CONFIG, list(overrides))
    opts = SwarmOptions(out_dir=tmp_path / "swarm", replicas=2, churn=churn, config_path=TEST_CONFIG,
                        overrides=overrides, faults=dict(faults or {}))
    return Swarm(cfg, opts, say=lambda s: None)


def _records(swarm: Swarm, name: str) -> list[dict[str, Any]]:
    return swarm.metrics.records.get(name, [])


def _events(swarm: Swarm, event: str) -> list[tuple[str, dict[str, Any]]]:
    return [(n, r) for n, rows in swarm.metrics.records.items() for r in rows if r.get("event") == event]


def _until(swarm: Swarm, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout_s:.0f}s\n{swarm.log_tails()}")
        swarm.step()
        time.sleep(0.05)  # polling period of a bounded wait


def _finish_clean(swarm: Swarm, iterations: int, timeout_s: float) -> dict[str, int]:
    if not swarm.run_until(iterations, timeout_s):
        pytest.fail(f"only {len(swarm.metrics.rows)}/{iterations} iterations in {timeout_s}s\n{swarm.log_tails()}")
    problems, totals = swarm.audit(iterations)
    assert not problems, "audit:\n" + "\n".join(problems[:20])
    leaders: dict[int, set[str]] = {}
    for node, r in _events(swarm, "leader_term"):
        leaders.setdefault(int(r["term"]), set()).add(str(r.get("me", node)))
    assert all(len(v) == 1 for v in leaders.values()), leaders
    return totals


def _served(swarm: Swarm, name: str) -> bool:
    return any(r.get("event") == "contribute" for r in _records(swarm, name))


def _joiners(swarm: Swarm) -> list[NodeProcess]:
    return [p for p in swarm.group.procs if p.name.startswith("j")]


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_high_churn_with_short_timeouts_finishes_and_every_joiner_serves(tmp_path: Path, seed: int) -> None:
    iterations = 40
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, f"train.seed={seed}", f"train.iterations={iterations}"),
                   "high")
    with swarm:
        swarm.start()
        _finish_clean(swarm, iterations, 200.0)
        joiners = _joiners(swarm)
        assert swarm.crashes >= 3 and len(joiners) == swarm.crashes, (swarm.crashes, [p.name for p in joiners])
        idle = [p.name for p in joiners if not _served(swarm, p.name)]
        assert not idle, f"joiners that never served: {idle}\n{swarm.log_tails()}"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_joiners_at_once_both_serve(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, "train.iterations=60"))
    with swarm:
        swarm.start()
        assert swarm.run_until(3, 60.0), swarm.log_tails()
        a, b = swarm.join_node(), swarm.join_node()
        _finish_clean(swarm, 60, 90.0)
        assert _served(swarm, a.name) and _served(swarm, b.name), swarm.log_tails()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_leader_and_relay_killed_at_once(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, "train.iterations=60"))
    with swarm:
        swarm.start()
        assert swarm.run_until(4, 60.0), swarm.log_tails()
        leader = next(p for p in swarm.group.procs if p.name == "dh0")
        relay = next(p for p in swarm.group.procs if p.name == "r1a")
        swarm.group.kill(leader)
        swarm.group.kill(relay)
        swarm.crashes += 2
        totals = _finish_clean(swarm, 60, 90.0)
        terms = sorted(int(r["term"]) for _, r in _events(swarm, "leader_term"))
        assert terms[0] == 0 and terms[-1] >= 1, terms  # a new term was elected
        assert totals["dropped"] >= 0


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_lost_stage_is_restored_from_the_checkpoint_by_a_later_joiner(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, "train.iterations=60"))
    with swarm:
        swarm.start()
        assert swarm.run_until(6, 60.0), swarm.log_tails()  # checkpoint v5 is on disk
        for name in ("r2a", "r2b"):
            swarm.group.kill(next(p for p in swarm.group.procs if p.name == name))
        _until(swarm, lambda: bool(_events(swarm, "stage_lost")), 30.0, "the leader's stage_lost")
        joiner = swarm.join_node()
        _finish_clean(swarm, 60, 120.0)
        rollbacks = [r for _, r in _events(swarm, "rollback")]
        assert rollbacks and rollbacks[-1]["version"] % 5 == 0, rollbacks
        assert swarm.stage_of(joiner) == 2 and _served(swarm, joiner.name), swarm.log_tails()


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_state_source_killed_while_exporting_leaves_the_joiner_to_restore_the_stage(tmp_path: Path) -> None:
    """Stage 1 is down to r1a, which dies as it starts exporting its state to a joiner (a fault at
    export_state): the joiner, not a member, hears of its source's death and, with no replica
    left, restores the stage from the checkpoint; the swarm rolls back to it and finishes."""
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, "train.iterations=60"), faults={"r1a": "kill:export_state"})
    with swarm:
        swarm.start()
        assert swarm.run_until(6, 60.0), swarm.log_tails()
        swarm.group.kill(next(p for p in swarm.group.procs if p.name == "r1b"))
        _until(swarm, lambda: any(r.get("node", "").startswith("r1b") for _, r in _events(swarm, "evict")),
               30.0, "r1b's eviction")
        joiner = swarm.join_node(stage="1")
        _until(swarm, lambda: any(r.get("event") == "fault" for r in _records(swarm, "r1a")), 30.0,
               "r1a's death at export_state")
        _finish_clean(swarm, 60, 120.0)
        assert _served(swarm, joiner.name), swarm.log_tails()
        assert [r for _, r in _events(swarm, "rollback")], "the stage came back from the checkpoint"
