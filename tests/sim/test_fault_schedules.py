"""200 seeded random fault schedules: crashes at random times and right after protocol records
(mid-forward, mid-backward, mid-aggregation, at a step, during a redo), leaves, joins, link cuts
and degradations, whole-stage losses. Every run: zero invariant violations (exactly once, same
weights, progress) and no deadlock. Long mode: `python tests/sim/faultgen.py --seeds 5000`."""

from __future__ import annotations

import pytest
from faultgen import random_schedule

from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario

SEEDS = 200
CHUNK = 10


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("reduce", ["gather", "butterfly"])
@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK))
def test_random_fault_schedules_keep_every_invariant(first: int, reduce: str, delay: int) -> None:
    """Both reductions on the same schedules (the butterfly's failures differ: every replica
    owns a part, so any replica's death breaks a round that gather's reducer would keep), and
    `train.update_delay` 1 (a crash during an overlapped round restarts its iteration)."""
    failures = []
    for seed in range(first, first + CHUNK):
        extra = [f'protocol.reduce="{reduce}"', f"train.update_delay={delay}"]
        summary, _ = run_scenario(load_scenario(None, random_schedule(seed) + extra), seed)
        if summary["invariant_violations"]:
            failures.append((seed, summary["violations"][:3]))
    assert not failures, failures


def test_schedules_cover_every_fault_kind() -> None:
    """The generator is not degenerate: the 200 seeds hit every kind of fault and trigger."""
    text = " ".join(" ".join(random_schedule(s)) for s in range(SEEDS))
    for needle in ('"crash_stage"', '"join"', '"cut"', '"degrade"', '"leave"', 'after_event="contribute"',
                   'after_event="collect"', 'after_event="redo"', 'after_event="decision"'):
        assert needle in text, needle


def test_a_collect_that_overtakes_its_iterstart_is_answered_for_the_new_iteration() -> None:
    """Long-mode seed 9253 on 120 nodes (views of 16, fan-out 2): a cut link made the leader
    resend Step, IterStart and Collect to one relay, and the Collect arrived first. The relay
    reported for its old iteration, which the leader ignores, and never again: the leader waited
    in its collect phase until the run's end with every stage alive (a deadlock)."""
    extra = ["nodes.count=120", "protocol.view_size=16", "protocol.reduce_fanout=2",
             # the seed's replay: a gather tree (reduce_fanout), with the fp32 message sizes that set its timing
             'protocol.reduce="gather"', 'wire.activations="fp32"', 'wire.gradients="fp32"',
             'wire.stage_gradients="fp32"']
    summary, _ = run_scenario(load_scenario(None, random_schedule(9253) + extra), 9253)
    assert summary["invariant_violations"] == 0, summary["violations"][:3]
    assert summary["iterations"] == 4


@pytest.mark.parametrize("seed", [20100, 20261, 21033, 21410, 501556, 501926])
def test_fresh_long_mode_seeds_that_failed_before_the_join_and_commit_fixes(seed: int) -> None:
    """Long-mode seeds found by this checker (which excuses an unfinished run only when no data
    holder, or no node for a lost stage, is left):
    - 20100: a resent Commit of round 1 overtook round 2's and the relay held round 1 for good;
    - 21033: two joiners pending at stage 2 when stage 3 was lost: nobody took stage 3 over;
    - 20261: a joiner sent to the lost stage was also activated at its old stage (Ready in flight);
    - 21410: a joiner whose Ready was waiting for the next iteration when its stage was lost was
      never activated (a paused swarm starts no iteration);
    - 501556: a joiner activated during an iteration lost the gradient share of a new leader's
      round that came before the leader's IterStart (which reset its shares);
    - 501926: a backward Redo from before a rollback that restarted iteration 0 turned the data
      holder's new forward (same microbatch id) into a chain to a dead cache, for good."""
    summary, _ = run_scenario(load_scenario(None, random_schedule(seed)), seed)
    assert summary["invariant_violations"] == 0, summary["violations"][:3]
    assert summary["finished"], summary["stop_reason"]


def test_a_swarm_joiner_sent_to_its_own_lost_stage_is_activated() -> None:
    """Long-mode SWARM seed 50220: SWARM's joiner picks its own stage (least throughput), not the
    leader's; when that stage was lost the leader sent it to join again for it, then ignored its
    Ready (for that very stage) as void: a deadlock with a live joiner for the lost stage."""
    summary, _ = run_scenario(load_scenario(None, random_schedule(50220)), 50220, "swarm")
    assert summary["invariant_violations"] == 0, summary["violations"][:3]
    assert summary["finished"], summary["stop_reason"]


def test_a_restarted_microbatch_passes_replicas_that_counted_it_already() -> None:
    """Fresh SWARM seed 650951: a data holder restarted a microbatch whose backward had been lost
    below stages that had counted it; each restart's chain ended at the first replica that had
    counted it (a duplicate, it assumed), so stage 1 never counted it and the iteration never
    finished. Such a replica now passes its cached input gradient down the chain."""
    summary, _ = run_scenario(load_scenario(None, random_schedule(650951)), 650951, "swarm")
    assert summary["invariant_violations"] == 0, summary["violations"][:3]
    assert summary["finished"], summary["stop_reason"]


@pytest.mark.parametrize("system", ["gwtf", "swarm"])
def test_fault_schedules_with_the_butterfly_all_reduce_keep_every_invariant(system: str) -> None:
    """`protocol.reduce = "butterfly"` (protocol/butterfly.py) on 20 schedules of their own
    range (long mode: `python tests/sim/faultgen.py --seeds 1000 --first 720000 --reduce butterfly`)."""
    failures = []
    for seed in range(720000, 720020):
        sc = load_scenario(None, [*random_schedule(seed), 'protocol.reduce="butterfly"'])
        summary, _ = run_scenario(sc, seed, system)
        if summary["invariant_violations"]:
            failures.append((seed, summary["violations"][:3]))
    assert not failures, failures


@pytest.mark.parametrize("seed", [143, 342])
def test_a_round_broken_after_a_data_holder_died_in_it_deals_that_holders_microbatches_again(seed: int) -> None:
    """Butterfly seeds 143 and 342: a data holder left during a commit whose round still counted
    its gradient (the other stage-0 replicas held theirs); then a stage-1 replica owning a part
    died and the round broke. The new round planned a redo chain starting at the dead data
    holder, every 12 s until the run's end (a deadlock with every stage alive). Its microbatches
    are lost once the round breaks: dealt again, the relays' parts of them void."""
    sc = load_scenario(None, random_schedule(seed) + ['protocol.reduce="butterfly"'])
    summary, _ = run_scenario(sc, seed)
    assert summary["invariant_violations"] == 0, summary["violations"][:3]
    assert summary["iterations"] == sc.train.iterations
