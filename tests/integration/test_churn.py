"""Churn in real node processes, with the short timeouts of configs/swarm-demo.toml (a kill -9 is
noticed within ~2 s): every run must finish, every joiner must serve, the ledger (and the
simulator's invariant checker replayed over the node records: exactly once, identical steps, one
leader per term) must be clean.

Cases: `--churn high` (a node killed, a relay, a data holder or the leader, and a joiner started
every 8 of 40 iterations) on 5 seeds; two joiners at once; the leader and a relay killed at once
(an election under load); both replicas of a stage killed, a joiner arriving later restores the stage from the checkpoint (on
the shared disk of one host, and from a data holder's copy when every node has its own disk);
the state source of a joiner killed as it exports the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TEST_CONFIG
from gwtf.config import load_config
from gwtf.runtime import checkpoints
from gwtf.runtime.launcher import NodeProcess
from gwtf.runtime.swarm import Swarm, SwarmOptions

# configs/swarm-demo.toml's failure detection (heartbeat 0.25 s, evict after 1.5 s) on the test model
DEMO_TIMEOUTS = ("protocol.heartbeat_period_s=0.25", "protocol.suspect_after_s=0.75", "protocol.evict_after_s=1.5",
                 "protocol.deadline_multiplier=4.0", "protocol.deadline_floor_s=1.0",
                 "protocol.mb_deadline_floor_s=20.0", "protocol.retry_period_s=0.2",
                 "protocol.partition_timeout_s=30.0", "protocol.checkpoint_every=5")

# 8 microbatches of 4 x 128 tokens per data holder: an iteration takes ~0.6-0.8 s on 2 cores, about
# as long as in `gwtf demo` (0.57 s), so a joiner (a new process: ~2-3 s to import torch and join)
# has the time the demo gives it (the test model's own shape runs ~0.1 s per iteration)
DEMO_SHAPE = ("model.seq_len=128", "model.microbatch_size=4", "train.microbatches=8")


def _swarm(tmp_path: Path, overrides: tuple[str, ...], churn: str = "none",
           faults: dict[str, str] | None = None, replicas: int = 2) -> Swarm:
    cfg = load_config(TEST_CONFIG, list(overrides))
    opts = SwarmOptions(out_dir=tmp_path / "swarm", replicas=replicas, churn=churn, config_path=TEST_CONFIG,
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
    high_churn_run(tmp_path, (f"train.seed={seed}",))


def high_churn_run(tmp_path: Path, extra: tuple[str, ...], iterations: int = 40) -> None:
    """`--churn high` with the demo's timeouts: the run finishes clean and every joiner serves."""
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, *extra, f"train.iterations={iterations}"), "high")
    with swarm:
        swarm.start()
        _finish_clean(swarm, iterations, 200.0)
        joiners = _joiners(swarm)
        assert swarm.crashes >= 3 and len(joiners) == swarm.crashes, (swarm.crashes, [p.name for p in joiners])
        idle = [p.name for p in joiners if not _served(swarm, p.name)]
        assert not idle, f"joiners that never served: {idle}\n{swarm.log_tails()}"


LONG = "train.iterations=100000"  # the scenario tests stop the swarm themselves, a few iterations after the event


def _done(swarm: Swarm) -> int:
    return swarm.metrics.next_iteration


def _run_on(swarm: Swarm, more: int, timeout_s: float) -> dict[str, int]:
    """Run `more` iterations past the present and check the ledger of all of them."""
    return _finish_clean(swarm, _done(swarm) + more, timeout_s)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_joiners_at_once_both_become_identical_replicas(tmp_path: Path) -> None:
    """Two joiners started at the same moment are both activated and then step with the same
    weights as the replicas of their stage (the audit compares every replica's hash at every
    step). Whether they carry microbatches is the router's choice: with spare capacity the flow
    router may leave a replica idle (the churn test above, where a joiner replaces a dead relay,
    asserts that joiners serve)."""
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, LONG))
    with swarm:
        swarm.start()
        assert swarm.run_until(3, 60.0), swarm.log_tails()
        a, b = swarm.join_node(), swarm.join_node()

        def stepping(name: str) -> bool:
            return any(r.get("event") == "stepped" for r in _records(swarm, name))

        _until(swarm, lambda: stepping(a.name) and stepping(b.name), 60.0, "both joiners stepping")
        _run_on(swarm, 3, 30.0)
        last = _done(swarm) - 1

        def stepped_last(name: str) -> bool:
            return any(r.get("event") == "stepped" and r["iteration"] == last for r in _records(swarm, name))

        # the run counts an iteration done once one replica of every stage logged its step; the others
        # log theirs a moment later (loop run 1 at e39ddde read the joiners' records 0.1 s too early)
        _until(swarm, lambda: stepped_last(a.name) and stepped_last(b.name), 20.0,
               f"both joiners logging their step of iteration {last}")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_leader_and_relay_killed_at_once(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, LONG))
    with swarm:
        swarm.start()
        assert swarm.run_until(4, 60.0), swarm.log_tails()
        for name in ("dh0", "r1a"):
            swarm.group.kill(next(p for p in swarm.group.procs if p.name == name))
        swarm.crashes += 2
        _run_on(swarm, 10, 60.0)
        terms = sorted(int(r["term"]) for _, r in _events(swarm, "leader_term"))
        assert terms[0] == 0 and terms[-1] >= 1, terms  # a new term was elected


def _lose_stage_2_then_refill(swarm: Swarm) -> NodeProcess:
    """kill -9 both replicas of stage 2, wait for the leader to pause, start a joiner, wait until
    it serves and run 5 more iterations; returns the joiner."""
    for name in ("r2a", "r2b"):
        swarm.group.kill(next(p for p in swarm.group.procs if p.name == name))
    _until(swarm, lambda: any(r["stages"] == [2] for _, r in _events(swarm, "stage_lost")), 30.0,
           "the leader's stage_lost")
    joiner = swarm.join_node()
    _until(swarm, lambda: _served(swarm, joiner.name), 60.0, "the joiner serving")
    _run_on(swarm, 5, 60.0)
    return joiner


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_lost_stage_is_restored_from_the_checkpoint_by_a_later_joiner(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, LONG))
    with swarm:
        swarm.start()
        assert swarm.run_until(6, 60.0), swarm.log_tails()  # checkpoint v5 is on disk
        joiner = _lose_stage_2_then_refill(swarm)
        # (lost_from 0 is the fresh swarm's start; a stage lost right at a checkpoint loses 0 iterations)
        rollbacks = [r for _, r in _events(swarm, "rollback") if r["lost_from"] > 0]
        assert rollbacks and rollbacks[-1]["version"] % 5 == 0, rollbacks
        assert swarm.stage_of(joiner) == 2, swarm.log_tails()


PER_NODE = 'runtime.checkpoint_folder="per-node"'  # a disk per node, as on several machines


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_lost_stage_is_restored_from_a_data_holders_copy_when_every_node_has_its_own_disk(tmp_path: Path) -> None:
    """Several hosts, emulated on one: every node keeps its checkpoints in its own folder, so the
    joiner's disk holds nothing of stage 2 and only the data holders' copies (sent to them by a
    stage-2 replica at each checkpoint) can bring the stage back."""
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, LONG, PER_NODE))
    nodes = tmp_path / "swarm" / "nodes"

    def stored(v: int) -> set[str]:
        return {n for n, r in _events(swarm, "checkpoint_stored") if r["stage"] == 2 and r["version"] == v}

    with swarm:
        swarm.start()
        assert swarm.run_until(6, 60.0), swarm.log_tails()
        _until(swarm, lambda: stored(5) == {"dh0", "dh1"}, 30.0, "both data holders keeping stage 2's v5")
        assert all(r["written"] for n, r in _events(swarm, "checkpoint_stored"))  # their own disks, not shared
        joiner = _lose_stage_2_then_refill(swarm)
        fetched = [r for n, r in _events(swarm, "checkpoint_fetched") if n == joiner.name]
        assert len(fetched) == 1 and fetched[0]["stage"] == 2, fetched
        version = int(fetched[0]["version"])
        assert str(fetched[0]["source"]).startswith("dh"), fetched
        imported = [r for n, r in _events(swarm, "state_imported") if n == joiner.name]
        # kept on the joiner's own disk (by the time of the checks below it may have written two
        # newer versions and pruned this one, so the record says it, not the folder)
        assert imported and imported[0]["checkpoint"] and imported[0]["written"], imported
        assert imported[0]["version"] == version, imported
        assert not [r for n, r in _events(swarm, "compute_failed") if n == joiner.name]
        rollbacks = [r for _, r in _events(swarm, "rollback") if r["lost_from"] > 0]
        assert rollbacks and rollbacks[-1]["version"] == version, rollbacks
        assert swarm.stage_of(joiner) == 2, swarm.log_tails()
        mine = nodes / joiner.name / "checkpoints"
        kept = [v for v in checkpoints.versions(mine, 2) if v >= version and checkpoints.verify_version(mine, 2, v) is None]
        assert kept, (version, checkpoints.versions(mine, 2))
        assert not (tmp_path / "swarm" / "checkpoints").exists()  # nothing was shared


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_state_source_killed_while_exporting_leaves_the_joiner_to_restore_the_stage(tmp_path: Path) -> None:
    """Stage 1 is down to r1a, which dies as it starts exporting its state to a joiner (a fault at
    export_state, of a version >= 6: not the start-up joins): the joiner, not a member, hears of its source's death and, with no replica
    left, restores the stage from the checkpoint; the swarm rolls back to it and goes on."""
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, LONG), faults={"r1a": "crash:compute=export_state:from=6"})
    with swarm:
        swarm.start()
        assert swarm.run_until(6, 60.0), swarm.log_tails()
        swarm.group.kill(next(p for p in swarm.group.procs if p.name == "r1b"))
        _until(swarm, lambda: any(r.get("node", "").startswith("r1b") for _, r in _events(swarm, "evict")),
               30.0, "r1b's eviction")
        joiner = swarm.join_node(stage="1")
        _until(swarm, lambda: any(r.get("event") == "fault" for r in _records(swarm, "r1a")), 30.0,
               "r1a's death at export_state")
        _until(swarm, lambda: _served(swarm, joiner.name), 60.0, "the joiner serving")
        _run_on(swarm, 5, 60.0)
        assert [r for _, r in _events(swarm, "rollback") if r["lost_from"] > 0], "restored from the checkpoint"
