"""The launcher's `--churn high` schedule (runtime/swarm.py): enough kills to be high churn, and
the last one early enough that its joiner can join and serve before the run ends (run 5 of the
integration loop: a joiner started after iteration 31 of 40 was activated for the last one and
never carried a microbatch)."""

from __future__ import annotations

import random

from gwtf.runtime.swarm import churn_iterations


def test_high_churn_kills_at_least_three_times_and_stops_a_period_and_a_half_before_the_end() -> None:
    for iterations in (40, 100, 300):
        every = iterations // 5
        for seed in range(200):
            kills = churn_iterations("high", iterations, random.Random(seed))
            assert len(kills) >= 3, (iterations, seed, kills)
            assert kills == sorted(set(kills)) and kills[0] >= 1
            assert iterations - kills[-1] > every + every // 2, (iterations, seed, kills)


def test_low_and_none() -> None:
    assert churn_iterations("none", 40, random.Random(0)) == []
    assert len(churn_iterations("low", 40, random.Random(0))) == 1
