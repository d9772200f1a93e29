"""The reduced gradient's broadcast tree (`protocol.reduce_fanout`, docs/protocol.md): every
replica is reached exactly once, no uplink carries more than `fanout` copies, and a tree parent
that dies holding the gradient (its children never get it) makes the leader agree again rather
than wait forever."""

from __future__ import annotations

import pytest
from simhooks import crash_on_delivery

from gwtf.errors import UserError
from gwtf.protocol.aggregation import digest, tree_children, tree_parent
from gwtf.protocol.messages import Commit, GradShare
from gwtf.protocol.systems import get_system
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import Simulator, run_scenario

SHAPE = ['model.preset="tiny"', "model.seq_len=64", "model.microbatch_size=4", "model.stages=3",
         "nodes.count=26", "nodes.data_holders=2", "nodes.relay_capacity=[1, 3]", "train.iterations=3",
         'protocol.reduce="gather"']  # reduce_fanout is a tree of the gather reduce


@pytest.mark.parametrize("fanout", [0, 2, 3, 7])
@pytest.mark.parametrize("n", [1, 2, 5, 30])
def test_the_tree_reaches_every_replica_once(fanout: int, n: int) -> None:
    replicas = tuple(f"r{i:02d}" for i in reversed(range(n)))
    d = digest(Commit(term=0, iteration=0, round=1, contributors=(), replicas=replicas))
    assert d.reducer == "r00"
    got = [c for r in replicas for c in tree_children(d, r, fanout)]
    assert sorted(got) == sorted(r for r in replicas if r != "r00")  # each once, never the reducer
    for r in replicas:
        kids = tree_children(d, r, fanout)
        assert fanout == 0 or len(kids) <= fanout
        assert all(tree_parent(d, c, fanout) == r for c in kids)
    depth = {"r00": 0}
    for r in d.order:  # parents come before their children in `order`
        depth[r] = depth[tree_parent(d, r, fanout)] + 1
    if fanout >= 2 and n > 1:
        assert max(depth.values()) <= 1 + (n - 1).bit_length()


def test_a_fanout_of_one_is_refused() -> None:
    with pytest.raises(UserError, match="protocol.reduce_fanout"):
        load_scenario(None, ["protocol.reduce_fanout=1"])


def test_training_with_a_broadcast_tree_keeps_the_invariants_and_is_faster() -> None:
    """With the 124M preset's gradients (~40 MB a stage) the reducer's uplink is the bottleneck of
    a star; with the tiny preset's, latency is, and a tree's extra hops cost more than they save."""
    big = [*SHAPE, 'model.preset="124m"', 'wire.stage_gradients="fp32"']  # fp32: the ~40 MB gradients above
    star, _ = run_scenario(load_scenario(None, big), 1)
    tree, _ = run_scenario(load_scenario(None, [*big, "protocol.reduce_fanout=2"]), 1)
    for s in (star, tree):
        assert s["finished"] and s["invariant_violations"] == 0, s["violations"]
    assert tree["training_time_s"] < star["training_time_s"]


def test_a_tree_parent_dying_with_the_gradient_forces_a_new_round() -> None:
    """Crash an inner node of the tree the moment the reduced gradient reaches it: the copies for
    its children are still on its uplink and are lost. Without the leader's tree check it waited
    for their Have forever (a progress violation)."""
    sc = load_scenario(None, [*SHAPE, "protocol.reduce_fanout=2"])
    sim = Simulator(sc, 1, get_system("gwtf", sc.protocol))
    crashed = crash_on_delivery(  # an inner node of the tree
        sim, lambda dst, msg, core: type(msg) is GradShare and msg.key[0] == "rgrad" and core.agg.commit is not None
        and bool(tree_children(digest(core.agg.commit), dst, 2)))
    summary = sim.run()
    assert crashed
    assert summary["finished"] and summary["invariant_violations"] == 0, summary["violations"]
    assert summary["iterations"] == 3
