"""A joiner takes a crashed data holder's place (DESIGN.md 5, data holder crash; issue 42): the
leader gives it the data holder's role on the vacant shard while fewer than `data_holders` are
live, it restores stage 0 from a live data holder and trains its shard's microbatches from the
iteration it is activated in; the invariant checker sees every microbatch exactly once."""

from __future__ import annotations

import random
from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.config import ProtocolConfig
from gwtf.protocol import messages as m
from gwtf.protocol.base import Send
from gwtf.protocol.core import NodeCore
from gwtf.protocol.invariants import InvariantChecker
from gwtf.protocol.router import PeerInfo

ITERATIONS = 12
SHARDED = replace(TRAIN, iterations=ITERATIONS, data_holders=2)


def _joiner(h: Harness, name: str, contact: str) -> NodeCore:
    j = NodeCore(PeerInfo(id=name, stage=-1, region="r", compute_s=0.1, capacity=4), h.cfg, h.train,
                 random.Random(name))
    h.cores[name] = j
    h.apply(name, j.on_start(h.now, [h.cores[contact].me]))
    return j


def _ask(leader: NodeCore, name: str, now: float, want: int = m.NONE, shard: int = -1) -> m.Welcome:
    """The leader's Welcome to joiner `name`'s JoinRequest."""
    out = leader.on_message(name, m.JoinRequest(peer=(name, -1, "r", 0.1, 4, 0, shard), want=want), now)
    (w,) = [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, m.Welcome)]
    return w


def _welcomes(h: Harness, to: str) -> list[m.Welcome]:
    return [msg for _, dst, msg in h.sent if dst == to and isinstance(msg, m.Welcome)]


def _started_by(h: Harness, node: str) -> set[int]:
    return {f["mb"][1] for f in h.events("mb_start") if f["mb"][0] == node}


def _checked(h: Harness, dead: dict[str, float]) -> InvariantChecker:
    chk = InvariantChecker(h.train.stages, 1e9, h.train.iterations)
    for node, at in dead.items():
        chk.on_dead(node, at)
    for now, node, event, fields in h.records:
        chk.on_record(now, node, event, fields)
    return chk


def _crash_d1_then_join(cfg: ProtocolConfig | None = None) -> tuple[Harness, float]:
    h = Harness(peers((2, 1, 1)), SHARDED, cfg=cfg)
    h.start()
    h.run(60.0, stop=lambda: any(f["iteration"] == 2 for f in h.events("iteration_done")))
    crashed_at = h.now
    h.crash("d1")
    h.run(h.now + 40.0, stop=lambda: bool(h.events("evict")))
    assert [f["node"] for f in h.events("evict")] == ["d1"]
    _joiner(h, "j0", "b0")  # through a relay: it forwards to the leader
    h.run(h.now + 300.0, stop=lambda: bool(h.events("training_done")))
    h.run(h.now + 5.0)  # the last Step reaches every replica
    return h, crashed_at


def _trained_data(h: Harness) -> dict[int, list[tuple[int, int]]]:
    """Iteration -> the batch's (shard, index) of every microbatch in stage 0's last decision."""
    data = {tuple(f["mb"]): tuple(f["data"]) for f in h.events("mb_start")}
    last: dict[int, dict[str, object]] = {}
    for f in h.events("decision"):
        if f["stage"] == 0:
            last[f["iteration"]] = f
    return {t: sorted(data[(dh, t, n)] for mbs in f["contributions"].values() for dh, n in mbs)  # type: ignore[attr-defined]
            for t, f in sorted(last.items())}


def test_a_joiner_takes_the_crashed_data_holders_shard_and_the_batch_is_held_meanwhile() -> None:
    h, crashed_at = _crash_d1_then_join()
    (w,) = _welcomes(h, "j0")
    assert (w.stage, w.shard) == (0, 1), (w.stage, w.shard)  # d1 served shard 1
    j = h.cores["j0"]
    assert (j.me.stage, j.me.shard, j.me.demand, j.active) == (0, 1, SHARDED.microbatches, True)
    assert [c.kind for n, c in h.computes if n == "j0"][0] == "import_state"  # stage 0 from d0
    assert h.events("training_done"), "the swarm did not finish after the data holder was replaced"
    first = h.events("activated")[0]["version"]
    # activated during iteration `first`, whose shard-1 microbatches d0 serves: it trains from the next
    assert _started_by(h, "j0") == set(range(first + 1, ITERATIONS)), (first, sorted(_started_by(h, "j0")))
    whole = sorted((s, i) for s in range(2) for i in range(SHARDED.microbatches))
    trained = _trained_data(h)
    short = [t for t, d in trained.items() if d != whole]
    assert len(short) <= 1, {t: trained[t] for t in short}  # at most the crash's own iteration
    held = [t for t in range(first + 1) if trained[t] == whole and not any(
        f["mb"][0] == "d1" and f["mb"][1] == t for f in h.events("mb_start"))]
    assert held, "no iteration without d1 trained shard 1 (served by d0)"
    chk = _checked(h, {"d1": crashed_at})
    assert chk.violations == [], chk.violations
    assert {c.version for c in h.cores.values()} == {ITERATIONS}


def test_without_holding_the_batch_a_data_holder_activated_mid_iteration_trains_it() -> None:
    h, crashed_at = _crash_d1_then_join(ProtocolConfig(hold_batch=False))
    assert h.cores["j0"].me.stage == 0 and h.events("training_done")
    first = h.events("activated")[0]["version"]
    # its own MemberUp (start = first) stands for the IterStart it missed: without it the leader
    # waited for its report for good
    assert _started_by(h, "j0") == set(range(first, ITERATIONS)), (first, sorted(_started_by(h, "j0")))
    assert _checked(h, {"d1": crashed_at}).violations == []


def test_the_papers_behaviour_the_joiner_is_a_relay_and_the_shard_stays_vacant() -> None:
    h, crashed_at = _crash_d1_then_join(ProtocolConfig(data_holder_joins=False, hold_batch=False))
    (w,) = _welcomes(h, "j0")
    assert w.stage >= 1 and w.shard == m.NONE
    assert h.cores["j0"].me.stage >= 1 and not _started_by(h, "j0")
    assert h.events("training_done")
    assert _trained_data(h)[ITERATIONS - 1] == [(0, i) for i in range(SHARDED.microbatches)]
    assert _checked(h, {"d1": crashed_at}).violations == []


def test_a_full_complement_of_data_holders_sends_joiners_to_the_relay_stages() -> None:
    h = Harness(peers((2, 1, 1)), SHARDED)
    h.start()
    h.run(0.5)
    w = _ask(h.cores["d0"], "j0", h.now)
    assert w.stage >= 1 and w.shard == m.NONE


def test_joiners_arriving_together_fill_each_vacant_shard_once() -> None:
    h = Harness(peers((3, 1, 1)), replace(SHARDED, data_holders=3))
    h.start()
    h.run(0.5)
    leader = h.cores["d0"]
    for pid in ("d1", "d2"):
        leader.members.evict(pid, False, h.now)
    got = []
    for name in ("j0", "j1", "j2"):
        w = _ask(leader, name, h.now)
        got.append((w.stage, w.shard))
    assert got[:2] == [(0, 1), (0, 2)] and got[2][0] >= 1 and got[2][1] == m.NONE, got


def test_a_joiner_that_wants_a_stage_gets_it() -> None:
    """An operator's `--stage 2` (or a rebalancing move's target) is honoured even while a shard is
    vacant; `--role data-holder` with its own shard keeps that shard."""
    h = Harness(peers((2, 1, 1)), SHARDED)
    h.start()
    h.run(0.5)
    leader = h.cores["d0"]
    leader.members.evict("d1", False, h.now)

    def welcome(name: str, want: int, shard: int = -1) -> tuple[int, int]:
        w = _ask(leader, name, h.now, want, shard)
        return w.stage, w.shard

    assert welcome("j0", 2) == (2, m.NONE)
    assert welcome("j1", 0, shard=0) == (0, 0)
    assert welcome("j2", 0) == (0, 1)


def _ready(leader: NodeCore, name: str, shard: int, now: float) -> list[object]:
    peer = (name, 0, "r", 0.1, 4, SHARDED.microbatches, shard)
    return leader.on_message(name, m.Ready(stage=0, version=leader.version, peer=peer), now)  # type: ignore[no-any-return]


def test_a_joiner_whose_shard_is_served_already_gets_another_or_joins_again() -> None:
    """Found by a 48-hour run (seed 0, iteration 849: data_twice): a leader died after giving a
    joiner a vacant shard, its successor never knew and gave the same shard to the next joiner;
    both became data holders of it. The leader now checks the shard at activation."""
    h = Harness(peers((3, 1, 1)), replace(SHARDED, data_holders=3))
    h.start()
    h.run(0.5)
    leader = h.cores["d0"]
    for pid in ("d1", "d2"):
        leader.members.evict(pid, False, h.now)
    _ready(leader, "j0", 1, h.now)
    assert leader.directory["j0"].shard == 1
    out = _ready(leader, "j1", 1, h.now)  # shard 1 again: j1 is given the vacant shard 2
    assert leader.directory["j1"].shard == 2
    (up,) = [e.msg for e in out if isinstance(e, Send) and e.to == "j1" and isinstance(e.msg, m.MemberUp)]
    assert up.peer[6] == 2
    out = _ready(leader, "j2", 2, h.now)  # no shard left: j2 joins again (a relay)
    assert "j2" not in leader.directory
    assert [e.msg.stage for e in out if isinstance(e, Send) and isinstance(e.msg, m.Refetch)] == [1]
    shards = sorted(p.shard for p in leader.directory.values() if p.stage == 0)
    assert shards == [0, 1, 2], shards


def _crash_mid_iteration(names: tuple[str, ...], peers_: tuple[int, ...] = (3, 2, 2)) -> tuple[Harness, dict[str, float]]:
    """Crash data holders `names` while iteration 3 runs: after a relay has back-propagated one
    of the first one's microbatches (so a relay's gradient holds a part of it)."""
    train = replace(TRAIN, iterations=8, data_holders=peers_[0], microbatches=3)
    h = Harness(peers(peers_), train)
    h.start()
    first = names[0]
    h.run(200.0, stop=lambda: any(f["mb"][0] == first and f["mb"][1] == 3 and f["stage"] > 0
                                  for f in h.events("contribute")))
    assert h.cores[first].iteration == 3
    dead = {}
    for n in names:
        h.crash(n)
        dead[n] = h.now
    h.run(h.now + 600.0, stop=lambda: bool(h.events("training_done")))
    h.run(h.now + 5.0)
    return h, dead


def test_a_data_holder_crashed_mid_iteration_has_its_microbatches_served_again_in_it() -> None:
    h, dead = _crash_mid_iteration(("d1",))
    assert h.events("training_done"), "the swarm did not finish"
    deals = [f for f in h.events("deal") if f["iteration"] == 3]
    assert deals and sum(f["items"] for f in deals) == 3, deals  # d1's shard 1, all of it
    # the relays' parts of d1's microbatches are void: their replicas were reset and redone
    assert any(f["iteration"] == 3 for f in h.events("agg_reset"))
    whole = sorted((s, i) for s in range(3) for i in range(3))
    trained = _trained_data(h)
    assert all(d == whole for d in trained.values()), {t: d for t, d in trained.items() if d != whole}
    for f in h.events("decision"):  # no stage counts a part of a dead data holder's microbatch
        if f["iteration"] == 3:
            assert not any(dh == "d1" for mbs in f["contributions"].values() for dh, _ in mbs), f
    chk = _checked(h, dead)
    assert chk.violations == [], chk.violations
    assert {c.version for c in h.cores.values()} == {8}


def test_the_leader_crashed_mid_iteration_its_successor_serves_its_microbatches() -> None:
    h, dead = _crash_mid_iteration(("d0",))
    assert h.events("training_done") and h.events("leader_takeover")
    whole = sorted((s, i) for s in range(3) for i in range(3))
    trained = _trained_data(h)
    assert all(d == whole for d in trained.values()), {t: d for t, d in trained.items() if d != whole}
    assert _checked(h, dead).violations == []


def test_two_of_three_data_holders_crashed_at_once_the_last_serves_the_whole_batch() -> None:
    h, dead = _crash_mid_iteration(("d1", "d2"))
    assert h.events("training_done")
    whole = sorted((s, i) for s in range(3) for i in range(3))
    trained = _trained_data(h)
    assert all(d == whole for d in trained.values()), {t: d for t, d in trained.items() if d != whole}
    assert _checked(h, dead).violations == []


def test_a_data_holder_lost_after_the_reducer_holds_its_gradient_is_counted_in_its_iteration() -> None:
    """Its gradient is in the reduction (the commit stands): the iteration trained its microbatches,
    and says so (`iteration_done`'s expected is the whole batch, nothing is dealt again)."""
    train = replace(TRAIN, iterations=6, data_holders=3, microbatches=3)
    h = Harness(peers((3, 2, 2)), train, cfg=ProtocolConfig(reduce="gather"))  # it is about gather's reducer
    h.start()
    # kill d2 once its gradient share of iteration 3 is on its way to d0 (stage 0's reducer, the
    # lowest id), before d2 holds the reduced gradient (it never says Have: the step waits for
    # its eviction, and by then the reducer holds every contributor's gradient)
    h.run(300.0, stop=lambda: any(s == "d2" and isinstance(m_, m.GradShare) and m_.key[2] == 3 for s, _, m_ in h.sent))
    assert not any(s == "d2" and isinstance(m_, m.Have) and m_.iteration == 3 for s, _, m_ in h.sent)
    h.crash("d2")
    dead = {"d2": h.now}
    h.run(h.now + 600.0, stop=lambda: bool(h.events("training_done")))
    done = {f["iteration"]: f["expected"] for f in h.events("iteration_done")}
    assert done[3] == 9, done
    assert not [f for f in h.events("deal") if f["iteration"] == 3]
    assert _checked(h, dead).violations == []


def test_every_data_holder_lost_at_once_pauses_and_two_joiners_resume_the_run() -> None:
    """No irreplaceable class (issue 42 item 4): with every data holder gone, a relay leads; stage
    0 is lost, so the swarm pauses; two joiners take the vacant shards (restoring stage 0 from the
    checkpoint), the swarm rolls back to it and trains to the end, every microbatch once."""
    train = replace(TRAIN, iterations=10, data_holders=2, microbatches=2)
    h = Harness(peers((2, 2, 2)), train, cfg=ProtocolConfig(checkpoint_every=2))
    h.start()
    h.run(300.0, stop=lambda: any(f["iteration"] == 4 for f in h.events("iteration_done")))
    dead = {}
    for n in ("d0", "d1"):
        h.crash(n)
        dead[n] = h.now
    h.run(h.now + 120.0, stop=lambda: bool(h.events("stage_lost")))
    assert h.events("stage_lost") and h.events("stage_lost")[-1]["stages"] == (0,), h.events("stage_lost")
    leaders = [f["node"] for f in h.events("leader_change") if f.get("leader") == f["node"]]
    assert leaders and all(h.cores[n].me.stage >= 1 for n in leaders), leaders  # a relay leads
    for j in ("j0", "j1"):
        _joiner(h, j, "b1")  # through a relay that does not lead
    h.run(h.now + 600.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done"), "the swarm did not resume"
    h.run(h.now + 5.0)  # the last Step reaches every replica
    assert {(h.cores[j].me.stage, h.cores[j].active) for j in ("j0", "j1")} == {(0, True)}
    assert sorted(h.cores[j].me.shard for j in ("j0", "j1")) == [0, 1]
    assert h.events("rollback"), "no rollback to the checkpoint"
    whole = sorted((s, i) for s in range(2) for i in range(2))
    trained = _trained_data(h)
    assert all(d == whole for d in trained.values()), {t: d for t, d in trained.items() if d != whole}
    assert _checked(h, dead).violations == []
    assert {c.version for c in h.cores.values()} == {10}
