"""Bounded views (`protocol.view_size`, protocol.view): each router sees about K peers of each
neighbouring stage, both ends agree on every edge, the shared roster's vectorised start gives
the same views as the per-peer rule used for later joins, and training under churn keeps every
invariant with views much smaller than the stages."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from gwtf.errors import UserError
from gwtf.protocol.systems import get_system
from gwtf.protocol.view import Roster, _pair_scores, mark, pair_score, view_threshold
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator, run_scenario

SHAPE = ['model.preset="tiny"', "model.seq_len=64", "model.microbatch_size=4", "model.stages=4",
         "nodes.count=400", "nodes.data_holders=8", "nodes.relay_capacity=[1, 3]"]


def _started(view_size: int, router: str = "flow") -> Simulator:
    sc = load_scenario(None, [*SHAPE, f"protocol.view_size={view_size}", f'protocol.router="{router}"'])
    sim = Simulator(sc, 3, get_system("gwtf", sc.protocol))
    sim.start()
    return sim


def test_vectorised_scores_equal_the_scalar_rule() -> None:
    rng = random.Random(5)
    ids = [f"n{rng.randrange(10**9)}" for _ in range(500)]
    marks = np.array([mark(i) for i in ids], dtype=np.uint64)
    a = mark("me")
    assert [int(v) for v in _pair_scores(marks, a)] == [pair_score(a, mark(i)) for i in ids]
    assert all(pair_score(mark(i), a) == pair_score(a, mark(i)) for i in ids)


def test_views_are_symmetric_bounded_and_match_the_per_peer_rule() -> None:
    k = 16
    sim = _started(k)
    cores = sim.cores
    sizes: list[int] = []
    for nid, core in cores.items():
        agent = core.router
        for peer in agent.state.next_peers:  # type: ignore[attr-defined]
            assert nid in cores[peer].router.state.prev_peers, (nid, peer)  # type: ignore[attr-defined]
        for peer in agent.state.prev_peers:  # type: ignore[attr-defined]
            assert nid in cores[peer].router.state.next_peers, (nid, peer)  # type: ignore[attr-defined]
        # the roster's start equals the rule a node applies to a peer it hears of later
        near = {p for p in core.directory.values() if (p.stage - core.me.stage) % 4 in (0, 1, 3) and p.id != nid}
        seen = set(agent.state.next_peers) | set(agent.state.prev_peers) | set(agent.state.same_peers)  # type: ignore[attr-defined]
        assert seen == {p.id for p in near if core.members.in_view(p)}
        if 0 < core.me.stage < 3:
            sizes.append(len(agent.state.next_peers))  # type: ignore[attr-defined]
        elif core.me.stage == 3:  # the way back: every data holder
            assert len(agent.state.next_peers) == 8  # type: ignore[attr-defined]
    relays_per_stage = (400 - 8) / 3
    assert relays_per_stage > 5 * k
    assert 0.7 * k < statistics.mean(sizes) < 1.3 * k, statistics.mean(sizes)
    assert min(sizes) >= 1


def test_no_view_or_a_small_stage_means_everyone() -> None:
    assert view_threshold(0, 500, 500) is None
    assert view_threshold(16, 10, 16) is None
    assert view_threshold(16, 17, 17) is not None
    # a stage no larger than K/2 is seen whole, however large the other stage is; a larger one
    # by at least K/2 of each node of a much larger stage
    assert view_threshold(16, 2, 30) is None and view_threshold(16, 30, 8) is None
    assert view_threshold(16, 17, 500) == view_threshold(16, 500, 17) == (16 << 64) // 34
    assert view_threshold(16, 750, 1000) == (16 << 64) // 1000  # within 2x: the larger stage
    sim = _started(0, router="greedy")
    core = next(c for c in sim.cores.values() if c.me.stage == 1)
    assert len(core.router._peers) == sum(1 for c in sim.cores.values() if c.me.stage == 2)  # type: ignore[attr-defined]
    roster = Roster([c.me for c in sim.cores.values()])
    everyone = {p.id for p in roster.members if p.stage in (0, 1, 2) and p.id != core.me.id}
    assert {p.id for p in roster.view(core.me, 4, 0)} == everyone


@pytest.mark.parametrize("seed", range(3))
def test_training_under_churn_with_small_views_keeps_every_invariant(seed: int) -> None:
    sc = load_scenario(None, [
        'model.preset="tiny"', "model.seq_len=64", "model.microbatch_size=4", "model.stages=3",
        "nodes.count=200", "nodes.data_holders=4", "nodes.relay_capacity=[1, 3]", "train.iterations=4",
        "train.microbatches=2", "protocol.view_size=16", "churn.crash_rate_per_hour=3.0",
        "churn.join_rate_per_hour=200.0", "sim.max_time_s=20000.0",
        # churn must hit these seeds' runs: their length is the gather reduce's with fp32 messages
        'wire.activations="fp32"', 'wire.gradients="fp32"', 'wire.stage_gradients="fp32"',
        'protocol.reduce="gather"',
    ])
    summary, _ = run_scenario(sc, seed)
    assert summary["finished"], summary
    assert summary["invariant_violations"] == 0, summary["violations"]
    assert summary["crashes"] > 0


def test_a_view_too_small_to_be_safe_is_refused() -> None:
    with pytest.raises(UserError, match="protocol.view_size"):
        load_scenario(None, ["protocol.view_size=15"])


def test_random_fault_schedules_with_small_views_keep_every_invariant() -> None:
    """The seeded fault schedules (whole-stage losses, crashes at protocol points, joins, cuts) on
    120 nodes, where a view of 16 is far smaller than a stage. Seeds 42 and 50 lose a whole
    stage and refill it with two joiners: before live stage sizes widened views, the data
    holders (whose view was drawn against the old stage of ~58) saw neither joiner and the run
    deadlocked."""
    from faultgen import random_schedule

    failures = []
    for seed in range(40, 60):
        overrides = [*random_schedule(seed), "nodes.count=120", "protocol.view_size=16", "train.microbatches=2"]
        summary, _ = run_scenario(load_scenario(None, overrides), seed)
        if summary["invariant_violations"]:
            failures.append((seed, summary["violations"][:2]))
    assert not failures, failures


@pytest.mark.parametrize("seed", [9364, 9370])
def test_a_refilled_stage_is_seen_by_every_node_of_a_larger_neighbouring_stage(seed: int) -> None:
    """Long-mode seeds (120 nodes, views of 16, fan-out 2): a next stage lost whole and refilled
    by two joiners while its previous stage kept ~30 relays. With the threshold scaled by the
    larger stage alone, a relay saw each joiner with probability 16/30; one that saw neither parked
    its microbatches for good, the data holder's restarts went to it again, and the run
    deadlocked with every stage alive."""
    from faultgen import random_schedule

    extra = ["nodes.count=120", "protocol.view_size=16", "protocol.reduce_fanout=2",
             # the seeds' replay: a gather tree (reduce_fanout), with the fp32 message sizes that set its timing
             'protocol.reduce="gather"', 'wire.activations="fp32"', 'wire.gradients="fp32"',
             'wire.stage_gradients="fp32"']
    summary, _ = run_scenario(load_scenario(None, random_schedule(seed) + extra), seed)
    assert summary["invariant_violations"] == 0, summary["violations"][:2]
