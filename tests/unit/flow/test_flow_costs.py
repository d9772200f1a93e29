"""The flow agent's distance vector (`FlowState.current_costs`, cached tables patched per advert, and
`cost_vector`, which takes a numpy path when every peer advertised one shared target tuple)
equals the plain definition min over next peers of d(me, n) + adv_n(t), through a seeded random
history of adverts (changing target sets, shared or not), single-entry refusal updates, link
changes, departures and arrivals."""

from __future__ import annotations

import random

import pytest

from gwtf.config import FlowConfig
from gwtf.protocol.router import LinkEstimate, PeerInfo
from gwtf.protocol.routing import FlowAgent
from gwtf.protocol.routing.messages import FlowAdvert
from gwtf.protocol.routing.state import INF, shared_targets


def _plain(agent: FlowAgent) -> dict[str, float]:
    """Least finite cost to each target (a target no peer reaches is absent, not inf)."""
    best: dict[str, float] = {}
    for nb in agent.state.next_peers.values():
        for t, c in nb.adv.items():
            best[t] = min(best.get(t, INF), nb.cost_s + c)
    return {t: c for t, c in best.items() if c < INF}


@pytest.mark.parametrize("seed", range(6))
def test_cost_vector_equals_the_plain_definition(seed: int) -> None:
    rng = random.Random(seed)
    me = PeerInfo("me", 1, "r0", 0.1, 4)
    agent = FlowAgent(me, 4, 1_000_000, FlowConfig(), random.Random(seed))
    agent.on_start(0.0)
    holders = [f"dh{i}" for i in range(12)]
    live: list[str] = []
    now = 0.0
    for step in range(400):
        now += 0.05
        roll = rng.random()
        if roll < 0.15 or len(live) < 3:
            pid = f"n{step}"
            link = LinkEstimate(rng.uniform(0.001, 0.2), rng.uniform(1e6, 1e9))
            agent.on_peer_up(PeerInfo(pid, 2, "r1", rng.uniform(0.05, 0.5), 3), link, now)
            live.append(pid)
        elif roll < 0.22:
            agent.on_peer_down(live.pop(rng.randrange(len(live))), now)
        elif roll < 0.30:
            pid = rng.choice(live)
            agent.on_link_update(pid, LinkEstimate(rng.uniform(0.001, 0.2), rng.uniform(1e6, 1e9)), now)
        elif roll < 0.36:
            nb = agent.state.next_peers[rng.choice(live)]
            nb.set_cost(rng.choice(holders), rng.uniform(0.0, 5.0))
            agent.state.costs_dirty = True
        else:
            targets = tuple(sorted(rng.sample(holders, rng.choice((12, 12, 12, 8)))))
            if rng.random() < 0.7:  # as a simulated swarm sends them: the advertiser's shared tuple
                targets = shared_targets(targets)
            costs = tuple(rng.choice((INF, rng.uniform(0.0, 5.0))) if rng.random() < 0.1 else rng.uniform(0.0, 5.0)
                          for _ in targets)
            agent.on_message(rng.choice(live), FlowAdvert(targets, costs, True), now)
        roll = rng.random()
        if roll < 0.4:
            assert agent.state.current_costs() == _plain(agent), f"step {step}"
        elif roll < 0.8:
            agent.state.costs_dirty = True
            targets, costs = agent.state.cost_vector()
            assert dict(zip(targets, costs)) == _plain(agent), f"step {step}"
            assert list(targets) == sorted(targets)
