"""The butterfly all-reduce (`protocol.reduce = "butterfly"`, protocol/butterfly.py): bytes per
node, parts and owners, and crashes mid-reduction.

Bytes: every gradient share a node sends in one reduction is counted (the simulator's sends):
a contributor sends (R-1) of its R parts and its reduced part to R-1 replicas, 2(R-1)/R of the
stage's gradient; gather's reducer sends R-1 whole gradients. Crashes: a replica killed the
moment its first part (reduce-scatter) or its first reduced part (all-gather) arrives takes a
part with it; the leader must agree again among the survivors (without `_commit_broken`'s
butterfly rule the survivors wait for the dead owner's part for good: a progress violation)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from simhooks import crash_on_delivery

from gwtf.errors import UserError
from gwtf.protocol.butterfly import layout, part_bytes, rotated
from gwtf.protocol.messages import Commit, GradShare
from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator

TINY = ['model.preset="tiny"', "model.seq_len=64", "model.microbatch_size=4", "model.stages=2",
        "train.iterations=2", "sim.max_time_s=1500.0", "sim.progress_bound_s=600.0"]


def _shape(r: int) -> list[str]:
    """R data holders (stage 0: every one contributes) and R relays (stage 1)."""
    return [*TINY, f"nodes.count={2 * r}", f"nodes.data_holders={r}", f"nodes.relay_capacity=[{r}, {r}]",
            "train.microbatches=2"]


def _sent_bytes(reduce: str, r: int) -> tuple[Simulator, dict[tuple[str, int, int], int], set[tuple[str, int]]]:
    """Gradient-share bytes by (node, stage, iteration) of a run without churn, and the
    (node, iteration) pairs that contributed."""
    sc = load_scenario(None, [*_shape(r), f'protocol.reduce="{reduce}"'])
    sim = Simulator(sc, 3, get_system("gwtf", sc.protocol))
    sent: dict[tuple[str, int, int], int] = defaultdict(int)
    contributed: set[tuple[str, int]] = set()
    send = sim._send

    def counting_send(src: str, dst: str, msg: object, now: float) -> None:
        if type(msg) is GradShare:
            sent[(src, sim.cores[src].me.stage, msg.iteration)] += msg.size_bytes
            if msg.key[0] == "pgrad":
                contributed.add((src, msg.iteration))
        send(src, dst, msg, now)  # type: ignore[arg-type]

    sim._send = counting_send  # type: ignore[method-assign]
    summary = sim.run()
    assert summary["finished"] and summary["invariant_violations"] == 0, summary["violations"]
    return sim, sent, contributed


@pytest.mark.parametrize("r", [2, 3, 4, 8])
def test_a_butterfly_sends_2_r_minus_1_over_r_of_a_gradient_per_node(r: int) -> None:
    sim, sent, contributed = _sent_bytes("butterfly", r)
    grad = sim.train.stage_grad_bytes
    want = {True: 2 * (r - 1) / r, False: (r - 1) / r}  # contributor / reduced part only
    checked = 0
    for (node, stage, it), got in sorted(sent.items()):
        share = got / grad[stage]
        assert abs(share - want[(node, it) in contributed]) <= 0.1 * want[True], (node, stage, it, share)
        checked += (node, it) in contributed
    assert checked >= r * 2  # every data holder contributes at stage 0, both iterations
    stage0 = [got / grad[0] for (_, stage, _), got in sent.items() if stage == 0]
    assert len(stage0) == 2 * r and all(abs(s - want[True]) <= 0.1 * want[True] for s in stage0), stage0


@pytest.mark.parametrize("r", [3, 8])
def test_gather_puts_r_minus_1_gradients_on_the_reducers_uplink(r: int) -> None:
    """The baseline the butterfly is measured against: the reducer's uplink carries R-1 gradients."""
    sim, sent, _ = _sent_bytes("gather", r)
    top = max(got / sim.train.stage_grad_bytes[stage] for (_, stage, _), got in sent.items())
    assert top == pytest.approx(r - 1, rel=0.01)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_parts_cover_the_gradient_and_every_owner_gets_one(n: int) -> None:
    replicas = tuple(f"r{i}" for i in reversed(range(n)))
    contributors = (("r1", 2), ("r0", 0)) if n > 1 else (("r0", 3),)
    lay = layout(Commit(term=0, iteration=0, round=1, contributors=contributors, replicas=replicas))
    assert lay.owners == tuple(sorted(replicas)) and lay.positive == (("r1",) if n > 1 else ("r0",))
    for size in (0, 1, 1000, 999_999):
        assert sum(part_bytes(size, n, j) for j in range(n)) == size
        assert max(part_bytes(size, n, j) for j in range(n)) - min(part_bytes(size, n, j) for j in range(n)) <= 1
    for i in range(n):
        assert sorted(rotated(lay.owners, i)) == [j for j in range(n) if j != i]


def test_butterfly_refuses_a_broadcast_tree() -> None:
    with pytest.raises(UserError, match="protocol.reduce_fanout"):
        load_scenario(None, ['protocol.reduce="butterfly"', "protocol.reduce_fanout=2"])
    with pytest.raises(UserError, match="protocol.reduce"):
        load_scenario(None, ['protocol.reduce="ring"'])


@pytest.mark.parametrize("phase", ["pgrad", "rgrad"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_replica_dying_mid_reduction_forces_a_new_round_among_the_survivors(phase: str, stage: int) -> None:
    """Crash the receiver of the first part (reduce-scatter) or of the first reduced part
    (all-gather) at a stage: the round is abandoned and a new one, without the dead replica,
    completes. Stage 0 holds the leader: the lowest-id data holder, never crashed here."""
    sc = load_scenario(None, [*_shape(4), 'protocol.reduce="butterfly"'])
    sim = Simulator(sc, 3, get_system("gwtf", sc.protocol))
    leader = min(sim.inst.by_stage[0])
    crashed = crash_on_delivery(sim, lambda dst, msg, core: type(msg) is GradShare and msg.key[0] == phase
                                and dst != leader and core.me.stage == stage)
    summary = sim.run()
    assert crashed
    assert summary["finished"] and summary["invariant_violations"] == 0, summary["violations"]
    assert summary["iterations"] == 2
    rounds = {c.round for c in (core.agg.commit for core in sim.cores.values()) if c is not None}
    assert rounds and min(rounds) >= 2  # the first iteration's round 1 was not the last
