"""A joiner of the 124m preset takes a relay stage's real state (487 MiB) in chunks.

One frame is capped at 256 MiB (`runtime.max_frame_bytes`), so this state can only travel as a
chunked transfer (32 MiB chunks, docs/wire.md); before chunking the send failed with
`WireError('frame too large')`. Real node processes, the real join path: the joiner picks its
stage, a live replica exports its state, the chunks stream over loopback, the joiner imports it,
and its weights hash must equal the exporter's at that version. Kept as small as the preset
allows on 2 cores: 3 stages (relay stages of 6 blocks), one data holder, one microbatch of 1 x 16
tokens, one replica per stage. Failure detection uses the protocol's defaults (heartbeat 2 s,
evict after 12 s), what a 124m swarm runs with: a 124m step and a 487 MiB copy take seconds on a
shared 2-core box, and swarm-test.toml's 3 s eviction evicts live relays there.

Then the joiner must serve (contribute a microbatch). On this box the transfer + import (~4-7 s)
takes longer than an iteration (~1.5 s): before the leader held an iteration start for a joiner
whose state kept going stale (`admit_hold`), the joiner fetched the state again at every
iteration (15 imports in 75 s observed) and never served.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from gwtf.runtime.swarm import Swarm

OVERRIDES = ('model.preset="124m"', "model.stages=3", "model.microbatch_size=1", "train.data_holders=1",
             "train.microbatches=1", "train.iterations=100000", 'protocol.router="greedy"',
             "protocol.heartbeat_period_s=2.0", "protocol.suspect_after_s=6.0", "protocol.evict_after_s=12.0")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_124m_joiner_takes_chunked_state_of_a_live_replica(make_swarm: Callable[..., Swarm]) -> None:
    swarm = make_swarm(OVERRIDES, replicas=1)
    swarm.start()
    assert swarm.run_until(2, timeout_s=60), swarm.log_tails()
    joiner = swarm.join_node()
    deadline = time.monotonic() + 45
    while not any(r["event"] == "state_imported" for r in swarm.metrics.records.get(joiner.name, [])):
        assert time.monotonic() < deadline, f"joiner imported no state:\n{swarm.log_tails()}"
        swarm.step()
        time.sleep(0.05)  # polling period of a bounded wait
    imported = next(r for r in swarm.metrics.records[joiner.name] if r["event"] == "state_imported")
    exported = [r for rows in swarm.metrics.records.values() for r in rows if r["event"] == "state_exported"]
    assert any(e["stage"] == imported["stage"] and e["version"] == imported["version"]
               and e["hash"] == imported["hash"] for e in exported), (imported, exported)
    assert "frame too large" not in swarm.log_tails(100_000)
    deadline = time.monotonic() + 60
    while not any(r["event"] == "contribute" for r in swarm.metrics.records.get(joiner.name, [])):
        assert time.monotonic() < deadline, f"joiner never served:\n{swarm.log_tails()}"
        swarm.step()
        time.sleep(0.05)  # polling period of a bounded wait
