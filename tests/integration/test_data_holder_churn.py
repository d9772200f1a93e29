"""Data holders replaced in real node processes (issue 42), with the demo's short timeouts: a
data holder is kill -9'd, a joiner started with `--stage auto` is made a data holder on the
vacant shard (it loads the corpus, restores stage 0 from the other data holder) and trains it;
meanwhile the other data holder serves the vacant shard too, so the run goes on with the full batch and the ledger audit (exactly once, identical replica hashes
at every step) and the simulator's invariant checker replayed over the records stay clean. One
case kills every original data holder, the leader first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_churn import DEMO_SHAPE, DEMO_TIMEOUTS, LONG, _done, _events, _records, _run_on, _swarm, _until

from gwtf.runtime.launcher import NodeProcess
from gwtf.runtime.swarm import Swarm


def _kill(swarm: Swarm, name: str) -> None:
    swarm.group.kill(next(p for p in swarm.group.procs if p.name == name))


def _holder_starts(swarm: Swarm, name: str) -> set[int]:
    """Iterations in which `name` started microbatches of its own (it served as a data holder)."""
    return {int(r["mb"][1]) for r in _records(swarm, name) if r.get("event") == "mb_start" and r["mb"][0] == _id(swarm, name)}


def _id(swarm: Swarm, name: str) -> str:
    proc = next(p for p in swarm.group.procs if p.name == name)
    assert proc.ready is not None
    return str(proc.ready["node"])


def _replace(swarm: Swarm, victim: str) -> NodeProcess:
    """kill -9 `victim` (a data holder), wait until the leader evicted it, start a joiner and wait
    until it trains its own microbatches as a data holder."""
    victim_id = _id(swarm, victim)
    _kill(swarm, victim)
    _until(swarm, lambda: any(r.get("node") == victim_id for _, r in _events(swarm, "evict")), 30.0,
           f"the eviction of {victim}")
    joiner = swarm.join_node()
    _until(swarm, lambda: bool(_holder_starts(swarm, joiner.name)), 90.0, f"joiner {joiner.name} training as a data holder")
    return joiner


def _batch(swarm: Swarm, iteration: int) -> int:
    mbs: set[tuple[Any, ...]] = {tuple(r["mb"]) for _, r in _events(swarm, "mb_start") if r["mb"][1] == iteration}
    return len(mbs)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_killed_data_holder_is_replaced_by_a_joiner_and_the_batch_is_whole_again(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, LONG))
    with swarm:
        swarm.start()
        assert swarm.run_until(3, 60.0), swarm.log_tails()
        full = _batch(swarm, 1)
        joiner = _replace(swarm, "dh1")
        stages = {r.get("stage") for r in _records(swarm, joiner.name) if r.get("event") == "activated"}
        assert stages == {0}, stages
        _run_on(swarm, 5, 60.0)
        last = _done(swarm) - 1
        assert _batch(swarm, last) == full, (_batch(swarm, last), full)
        # the batch is held (protocol.hold_batch): while the shard waited for the joiner, dh0
        # served its microbatches too, and in the crash's own iteration those dh1 had in flight
        short = {r["iteration"]: r["microbatches"] for r in swarm.metrics.rows if r["microbatches"] != full}
        assert short == {}, short


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_every_original_data_holder_killed_the_leader_first(tmp_path: Path) -> None:
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, LONG))
    with swarm:
        swarm.start()
        assert swarm.run_until(3, 60.0), swarm.log_tails()
        first = _replace(swarm, "dh0")  # the leader: dh1 takes over, then admits the joiner
        _run_on(swarm, 3, 60.0)
        second = _replace(swarm, "dh1")  # the last original data holder: the joiner leads now
        _run_on(swarm, 5, 60.0)
        assert all(p.state == "killed" for p in swarm.group.procs if p.name in ("dh0", "dh1"))
        leaders = {str(r.get("me", n)) for n, r in _events(swarm, "leader_term")}
        assert _id(swarm, first.name) in leaders or _id(swarm, second.name) in leaders, leaders
        last = _done(swarm) - 1
        assert _holder_starts(swarm, first.name) >= {last} and _holder_starts(swarm, second.name) >= {last}


def _any_record(swarm: Swarm, event: str, stage: int | None = None) -> bool:
    return any(r.get("event") == event and (stage is None or stage in r.get("stages", ()))
               for recs in swarm.metrics.records.values() for r in recs)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_every_data_holder_killed_at_once_pauses_and_two_joiners_resume(tmp_path: Path) -> None:
    """No irreplaceable class (issue 42 item 4): kill -9 of both data holders at the same moment.
    A relay takes the lead, stage 0 is lost and training pauses; two joiners become the data
    holders of the vacant shards (stage 0 from its checkpoint), the swarm rolls back to it and
    trains on, the audit clean."""
    swarm = _swarm(tmp_path, (*DEMO_TIMEOUTS, *DEMO_SHAPE, LONG))
    with swarm:
        swarm.start()
        assert swarm.run_until(7, 60.0), swarm.log_tails()
        _kill(swarm, "dh0")
        _kill(swarm, "dh1")
        _until(swarm, lambda: _any_record(swarm, "stage_lost", 0), 30.0, "the pause (stage 0 lost)")
        leaders = {n for n, r in _events(swarm, "leader_term")}
        assert leaders - {"dh0", "dh1"}, leaders  # a relay leads
        joiners = [swarm.join_node(), swarm.join_node()]
        _until(swarm, lambda: all(_holder_starts(swarm, j.name) for j in joiners), 90.0,
               "both joiners training as data holders")
        assert _any_record(swarm, "rollback")
        _run_on(swarm, 4, 90.0)
