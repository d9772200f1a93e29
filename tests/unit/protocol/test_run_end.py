"""The run's end (issue 44): the leader's Finish after the last Step ends every member (its own
`training_over`), the data holders first holding every relay stage's checkpoint of the final
version (one copy each, also when that version is not a multiple of checkpoint_every); nobody
is evicted or counted lost at the end."""

from __future__ import annotations

from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.config import ProtocolConfig


def _ended(h: Harness) -> dict[str, dict[str, object]]:
    return {f["node"]: f for f in h.events("training_over")}


def test_every_member_ends_with_the_leader_and_the_data_holders_hold_the_final_copies() -> None:
    h = Harness(peers((2, 2, 1)), replace(TRAIN, iterations=3), cfg=ProtocolConfig(checkpoint_every=2))
    h.start()
    h.run(300.0, stop=lambda: len(_ended(h)) == len(h.cores))
    ended = _ended(h)
    assert set(ended) == set(h.cores), sorted(ended)
    assert {f["version"] for f in ended.values()} == {3} and {f["holding"] for f in ended.values()} == {3}
    for dh in ("d0", "d1"):
        assert h.cores[dh].agg.copies == {1: 3, 2: 3}, h.cores[dh].agg.copies  # v3 is not a multiple of 2
        assert ended[dh]["copies_missing"] == ()
    waits = {f["node"] for f in h.events("final_copies_wait")}
    assert waits <= {"d0", "d1"}
    h.run(h.now + 60.0)  # members stopped heartbeating: the finished leader evicts nobody
    assert not h.events("evict") and not h.events("dh_lost")


def test_a_data_holder_whose_copy_never_comes_ends_after_a_bounded_wait_and_says_so() -> None:
    h = Harness(peers((2, 1, 1)), replace(TRAIN, iterations=2), cfg=ProtocolConfig(checkpoint_every=2))
    h.drop = lambda src, dst, msg: src == "b0" and type(msg).__name__ == "StateTransfer"  # stage 2's copies are lost
    h.start()
    h.run(600.0, stop=lambda: len(_ended(h)) == len(h.cores))
    ended = _ended(h)
    assert set(ended) == set(h.cores)
    assert ended["d0"]["copies_missing"] == (2,) and ended["d1"]["copies_missing"] == (2,)
    assert ended["a0"]["copies_missing"] == ()
    assert {f["node"] for f in h.events("final_copies_wait")} == {"d0", "d1"}


def test_without_checkpoint_copies_a_data_holder_ends_at_once() -> None:
    h = Harness(peers((2, 1, 1)), replace(TRAIN, iterations=2), cfg=ProtocolConfig(checkpoint_replicate=False))
    h.start()
    h.run(300.0, stop=lambda: len(_ended(h)) == len(h.cores))
    assert set(_ended(h)) == set(h.cores) and not h.events("final_copies_wait")
