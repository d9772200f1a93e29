"""A resumed swarm's core starts at `NodeCore.start_version` (the runtime's `--resume`).

The runtime way of starting: one bootstrap data holder, every other node joins through it with a
fixed stage. The leader must start (and hold, until `start_members` are in) iteration V, roll
every node back to checkpoint V, and train V, V+1, ... - never iterations before V.
"""

from __future__ import annotations

import random
from dataclasses import replace

from core_harness import TRAIN, Harness

from gwtf.config import ProtocolConfig
from gwtf.protocol.core import NodeCore
from gwtf.protocol.router import PeerInfo

V = 5


def _info(node: str, stage: int) -> PeerInfo:
    return PeerInfo(id=node, stage=stage, region="r", compute_s=0.1, capacity=4, demand=2 if stage == 0 else 0)


def _resumed_swarm(start_version: int) -> Harness:
    train = replace(TRAIN, iterations=V + 2)
    cfg = ProtocolConfig(checkpoint_every=V)
    h = Harness([], train=train, cfg=cfg)
    plan = {"d0": 0, "d1": 0, "a0": 1, "b0": 2}
    for node, stage in plan.items():
        bootstrap = node == "d0"
        core = NodeCore(_info(node, stage if bootstrap else -1), cfg, train, random.Random(node))
        core.fixed_stage = None if bootstrap else stage
        core.start_members = len(plan)
        core.start_version = start_version if bootstrap else 0  # joiners follow the leader
        h.cores[node] = core
    h.apply("d0", h.cores["d0"].on_start(0.0, [_info("d0", 0)]))
    for node in ("a0", "b0", "d1"):  # d1 last: all stages are served before every member is in
        h.apply(node, h.cores[node].on_start(0.0, [_info("d0", -1)]))
    return h


def test_leader_starts_holds_and_rolls_back_at_the_start_version() -> None:
    h = _resumed_swarm(V)
    h.run(60.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done") == [{"iterations": V + 2}]
    done = [f["iteration"] for f in h.events("iteration_done")]
    assert done == [V, V + 1]
    rollbacks = [(t, f) for t, _, e, f in h.records if e == "rollback"]
    assert [f["version"] for _, f in rollbacks] == [V]  # every node reloads checkpoint V
    last_join = max(t for t, _, e, _ in h.records if e == "join")
    assert rollbacks[0][0] >= last_join  # held until all start_members were in
    starts = [f for f in h.events("iter_start")]
    assert all(f["iteration"] >= V for f in starts)
    assert starts[-1]["iteration"] == V + 1 and starts[-2] == {"iteration": V, "members": 4}
    loaded = sorted(n for _, n, e, f in h.records if e == "rollback_node" and f["version"] == V)
    assert loaded == ["a0", "b0", "d0", "d1"]
    welcomes = [m for _, _, m in h.sent if type(m).__name__ == "Welcome"]
    assert welcomes and all(w.checkpoint_iteration == V and w.iteration == V for w in welcomes)


def test_default_start_version_starts_at_zero() -> None:
    h = _resumed_swarm(0)
    h.run(60.0, stop=lambda: len(h.events("iteration_done")) >= 1)
    assert [f["iteration"] for f in h.events("iteration_done")][:1] == [0]
