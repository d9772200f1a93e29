"""kill -9 at named protocol points: training continues and the exactly-once ledger holds.

Four real node processes (data holders dh0, dh1; relays r1a, r1b of stage 1 of 2). One node
carries a fault (`runtime.fault`, docs/faults.md) that SIGKILLs it at a protocol point: a relay
mid-forward or mid-backward at its first microbatch from iteration 2 on (the router decides which
replica carries an iteration, and may send all of one iteration through the other relay), or during
aggregation of iteration 2 (before its gradient is shared), or a data holder mid-microbatch of
iteration 2, or a relay right after its first `contribute` record from iteration 2 on (a record
trigger: mid-backward, its gradient reported but not yet sent). The swarm must finish all iterations, the ledger
checked from the node logs must show every expected microbatch counted exactly once at every
stage with identical replica weights, the victim must have died by SIGKILL at that point, a dead
relay's work must have been recovered by its path (a forward resent to the other replica, an
in-flight microbatch redone, or at aggregation exactly the microbatches it had accumulated
redone), and the fixtures prove that no process outlives the test.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

from gwtf.runtime.swarm import Swarm

ITERATIONS = 8
OVERRIDES = ("model.stages=2", f"train.iterations={ITERATIONS}")
# gwtf's flow router may carry every microbatch of a run through one relay (a data holder's
# unreserved microbatches go to the cheapest replica), so the cases that need the victim to
# carry traffic (every relay case: each checks that the victim's work was recovered) use the
# greedy router, which spreads microbatches over both replicas.
SPREAD = ('protocol.router="greedy"',)


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victim", "fault", "router", "recovery"),
    [
        ("r1a", "crash:compute=forward:from=2", SPREAD, "reroute"),
        ("r1a", "crash:compute=backward:from=2", SPREAD, "inflight"),
        ("r1a", "crash:compute=aggregate:iter=2", SPREAD, "aggregation"),
        ("dh1", "crash:compute=loss:iter=2:mb=1", (), ""),
        ("r1a", "crash:after=contribute:from=2", SPREAD, "inflight"),
    ],
    ids=["relay-forward", "relay-backward", "relay-aggregation", "data-holder", "relay-record"],
)
def test_kill_at_protocol_point_is_survived_exactly_once(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], victim: str, fault: str,
    router: tuple[str, ...], recovery: str,
) -> None:
    swarm = make_swarm(OVERRIDES + router, faults={victim: fault})
    swarm.start()
    totals = finish(swarm, ITERATIONS, 90.0)
    proc = next(p for p in swarm.group.procs if p.name == victim)
    assert proc.popen.poll() == -signal.SIGKILL, f"{victim} did not die by SIGKILL:\n{proc.log_tail()}"
    fired = [r for r in swarm.metrics.records.get(victim, []) if r.get("event") == "fault"]
    assert len(fired) == 1 and fired[0]["iteration"] >= 2, fired
    assert "from=" in fault or fired[0]["iteration"] == 2, fired
    rows = swarm.metrics.rows
    assert [r["iteration"] for r in rows[:ITERATIONS]] == list(range(ITERATIONS))
    if victim.startswith("dh"):
        # its in-flight microbatches are counted (dh_lost) as served again, not dropped
        assert totals["reserved"] >= 1 and totals["dropped"] == 0, totals
        assert (totals["full_batch"], totals["short_iterations"]) == (4, 0), totals["short_detail"]
        # the batch is held (protocol.hold_batch): dh0 serves dh1's in-flight microbatches again in
        # the crash's iteration, and dh1's vacant shard from the next on: every iteration trains
        # both shards' microbatches, 2 x 2, at both stages
        assert all(r["microbatches"] == 4 for r in rows[:ITERATIONS]), [r["microbatches"] for r in rows]
        assert totals["expected"] == 4 * ITERATIONS * 2
    else:
        assert totals["dropped"] == 0
        assert totals["expected"] == 4 * ITERATIONS * 2, "every microbatch counted at both stages"
        _assert_recovered(swarm, victim, fired[0], recovery)


def _assert_recovered(swarm: Swarm, victim: str, fired: dict[str, Any], recovery: str) -> None:
    """The dead relay's work of the iteration it died in was recovered on the other replica.

    `reroute`: a forward sent to it was resent elsewhere; `inflight`: a microbatch it held
    mid-backward was redone; `aggregation`: the microbatches it had accumulated for the
    iteration, and only those, were redone. The swarm's metrics row counts the same records."""
    it = fired["iteration"]
    records = [r for recs in swarm.metrics.records.values() for r in recs]
    if recovery == "reroute":
        done = [r for r in records if r.get("event") == "reroute" and r.get("dead") == fired["me"]]
        column = "microbatches_rerouted"
    else:
        done = [r for r in records if r.get("event") == "redo" and r.get("mode") == recovery]
        column = "microbatches_redone"
    now = [r for r in done if r["mb"][1] == it]
    assert now, f"{victim} died at {fired} but no {recovery} record of iteration {it} names its work: {done}"
    assert min(r["mb"][1] for r in done) == it, done  # nothing before the crash was recovered
    assert swarm.metrics.rows[it][column] >= len(now), swarm.metrics.rows[it]
    if recovery == "aggregation":
        held = {tuple(r["mb"]) for r in swarm.metrics.records.get(victim, [])
                if r.get("event") == "contribute" and r["mb"][1] == it}
        assert held, f"{victim} accumulated nothing in iteration {it}: the case checks no redo"
        assert {tuple(r["mb"]) for r in now} == held
