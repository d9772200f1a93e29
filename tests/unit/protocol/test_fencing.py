"""Fenced leadership (DESIGN.md 5, Raft section 5.2): control messages carry the leader's term
and are refused when stale or not from that term's leader; votes come from members only, one
per voter per term; a leader that hears of a newer term steps down."""

from __future__ import annotations

from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.protocol import messages as m
from gwtf.protocol.base import Send

ONE = replace(TRAIN, microbatches=1, iterations=3)


def _started(sizes: tuple[int, ...] = (2, 2, 1)) -> Harness:
    h = Harness(peers(sizes), ONE)
    h.start()
    h.run(0.5)
    return h


def _sends(effects: list[object], kind: type) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and isinstance(e.msg, kind)]


def test_the_initial_leader_leads_term_zero_and_everyone_follows_it() -> None:
    h = _started()
    assert [f["node"] for f in h.events("leader_term")] == ["d0"]
    assert {c.term for c in h.cores.values()} == {0}
    assert {c.leader for c in h.cores.values()} == {"d0"}


def test_a_forged_evicted_or_rollback_from_a_member_that_does_not_lead_is_refused() -> None:
    h = _started()
    relay = h.cores["a0"]
    out = relay.on_message("d1", m.Evicted(term=0), h.now)
    assert relay.alive and not any(getattr(e, "event", "") == "self_stop" for e in out)
    version = relay.version
    out = relay.on_message("b0", m.Rollback(term=0, version=0, lost_from=5), h.now)
    assert relay.version == version and relay.alive
    assert not [e for e in out if getattr(e, "event", "") == "rollback_node"]


def test_a_stale_term_is_refused_and_answered_with_the_current_one() -> None:
    h = _started()
    relay = h.cores["a0"]
    relay.on_message("d1", m.IterStart(term=3, iteration=relay.iteration, leader="d1"), h.now)
    assert (relay.term, relay.leader) == (3, "d1")  # a newer term is adopted with its sender
    out = relay.on_message("d0", m.Step(term=0, iteration=relay.iteration, round=1), h.now)
    notices = _sends(out, m.TermNotice)
    assert [(s.to, s.msg.term, s.msg.leader) for s in notices] == [("d0", 3, "d1")]
    assert relay.version == 0  # the stale Step was not applied


def test_a_leader_that_hears_of_a_newer_term_steps_down() -> None:
    h = _started()
    leader = h.cores["d0"]
    out = leader.on_message("a0", m.TermNotice(term=2, leader="d1"), h.now)
    assert not leader.is_leader and (leader.term, leader.leader) == (2, "d1")
    assert [getattr(e, "event", "") for e in out] == ["leader_stepdown"]


def test_votes_from_non_members_are_ignored_and_a_majority_of_members_elects() -> None:
    h = _started()
    cand = h.cores["d1"]
    members = sorted(cand.directory)  # d0 d1 a0 a1 b0: voters are the 4 besides the old leader d0
    for stranger in ("j1", "j2", "j3", "j4"):
        cand.on_message(stranger, m.LeaderVote(term=1, old="d0"), h.now)
    assert not cand.is_leader and cand.term == 0
    cand.on_message("a0", m.LeaderVote(term=1, old="d0"), h.now)
    cand.on_message("a1", m.LeaderVote(term=1, old="d0"), h.now)
    assert not cand.is_leader  # 2 of 4 is no strict majority
    out = cand.on_message("b0", m.LeaderVote(term=1, old="d0"), h.now)
    assert cand.is_leader and cand.term == 1 and len(members) == 5
    assert any(getattr(f, "event", "") == "leader_term" for f in out)


def test_one_vote_per_voter_per_term() -> None:
    """A voter that lost its leader votes once per term: moving to another candidate (the first
    one unreachable) takes a new term, so two candidates can never both win the same term."""
    h = _started((3, 2, 1))
    voter = h.cores["a0"]
    voter.members.last_leader_s = -100.0
    first = _sends(voter.members._vote(h.now), m.LeaderVote)
    voter.members.vote_failed_to(first[0].to)
    second = _sends(voter.members._vote(h.now), m.LeaderVote)
    assert first[0].to != second[0].to
    assert second[0].msg.term == first[0].msg.term + 1


def test_stale_ballots_expire() -> None:
    """A voter that heard from the leader again stops renewing its vote; its old ballot must not
    add up with later ones into a majority that deposes a live leader."""
    h = _started()
    cand = h.cores["d1"]
    cand.on_message("a0", m.LeaderVote(term=1, old="d0"), 0.0)
    cand.on_message("a1", m.LeaderVote(term=1, old="d0"), 0.0)
    later = 10 * cand.cfg.evict_after_s
    cand.on_message("b0", m.LeaderVote(term=1, old="d0"), later)
    assert not cand.is_leader
