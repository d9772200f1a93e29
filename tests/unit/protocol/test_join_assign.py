"""The leader assigns joiners a stage counting the joiners still pending, and forgets the
assignment once they are members: nodes that join together spread over the stages, and a
joiner that served and died no longer counts as capacity of its stage."""

from __future__ import annotations

from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.protocol import messages as m
from gwtf.protocol.base import Send
from gwtf.protocol.membership import UNKNOWN_STAGE_LOAD


def _welcome_stage(out: list[object]) -> int:
    (w,) = [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, m.Welcome)]
    return int(w.stage)


def _join(leader: object, name: str, now: float) -> int:
    peer = (name, -1, "r", 0.1, 4, 0, -1)
    return _welcome_stage(leader.on_message(name, m.JoinRequest(peer=peer), now))  # type: ignore[attr-defined]


def test_joiners_arriving_together_spread_over_the_stages() -> None:
    h = Harness(peers((1, 1, 1)), replace(TRAIN, iterations=50))
    h.start()
    h.run(0.5)
    leader = h.cores["d0"]
    stages = [_join(leader, f"j{i}", h.now) for i in range(4)]
    assert sorted(stages) == [1, 1, 2, 2], stages


def test_a_joiner_that_became_a_member_and_died_is_not_counted_again() -> None:
    """In the runtime every node but the bootstrap joins: both replicas of stage 2 had pending
    assignments that outlived their activation; once both died, stage 2 still looked served
    and the next joiner was sent to stage 1 (the lost stage stayed lost)."""
    h = Harness(peers((1, 1, 1)), replace(TRAIN, iterations=50))
    h.start()
    h.run(0.5)
    leader = h.cores["d0"]
    stage = _join(leader, "j0", h.now)
    info = ("j0", stage, "r", 0.1, 4, 0, -1)
    leader.on_message("j0", m.Ready(stage=stage, version=leader.version, peer=info), h.now)
    assert "j0" in leader.directory
    for pid in [p for p, i in leader.directory.items() if i.stage == stage]:
        leader.members.evict(pid, False, h.now)
    assert leader.members.utilisation()[stage] == UNKNOWN_STAGE_LOAD
    assert _join(leader, "j1", h.now) == stage
