"""A node joining mid-training gets weights + optimizer state, serves, and matches its peers.

Three processes train (data holders dh0, dh1; relay r1a, the only replica of stage 1 of 2; a long
run, so it is still going when the joiner arrives); after iteration 3 a fourth process joins with `--stage auto` through a random live node. It must pick
stage 1, import a live replica's state (its weights hash equals the exporter's), become active at
an iteration boundary, back-propagate microbatches, and after every step it takes part in hold
exactly r1a's weights (checked with the ledger audit, which compares every replica's hash).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from gwtf.runtime.swarm import Swarm

ITERATIONS = 100_000  # never reached: the test stops once the joiner has stepped 3 times


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_joiner_gets_state_serves_and_stays_identical(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]]
) -> None:
    # The greedy router spreads microbatches over every live replica, so the joiner must serve.
    # gwtf's flow router moves flows to a joiner only when that lowers the max route cost or the
    # flow needs its capacity, which two equal loopback relays never do.
    swarm = make_swarm(("model.stages=2", f"train.iterations={ITERATIONS}", 'protocol.router="greedy"'), replicas=1)
    swarm.start()
    assert swarm.run_until(3, timeout_s=60), swarm.log_tails()
    joiner = swarm.join_node()
    assert swarm.run_until(4, timeout_s=10)
    deadline = time.monotonic() + 80
    while sum(1 for (_, stage), h in swarm.metrics.hashes.items() if stage == 1 and joiner.name in h) < 3:
        assert time.monotonic() < deadline, f"joiner never stepped 3 times:\n{swarm.log_tails()}"
        swarm.step()
        time.sleep(0.05)  # polling period of a bounded wait
    done = len(swarm.metrics.rows)
    totals = finish(swarm, done, 30.0)
    records = swarm.metrics.records[joiner.name]
    events = [r["event"] for r in records]
    assert "activated" in events, f"{joiner.name} never became active:\n{joiner.log_tail()}"
    imported = [r for r in records if r["event"] == "state_imported"]
    assert imported and imported[-1]["stage"] == 1
    exported = [r for rows in swarm.metrics.records.values() for r in rows if r["event"] == "state_exported"]
    assert any(e["hash"] == imported[-1]["hash"] and e["version"] == imported[-1]["version"] for e in exported)
    served = [r for r in records if r["event"] == "contribute"]
    assert served, "the joiner never back-propagated a microbatch"
    stepped = [(it, hashes) for (it, stage), hashes in sorted(swarm.metrics.hashes.items())
               if stage == 1 and it < done and joiner.name in hashes]
    assert stepped, "the joiner never stepped"
    for it, hashes in stepped:
        assert hashes[joiner.name] == hashes["r1a"], f"joiner diverged from r1a at iteration {it}"
    assert totals["expected"] == 4 * done * 2
