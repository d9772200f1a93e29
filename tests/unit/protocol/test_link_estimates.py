"""Bandwidth samples from receipt acks: measured delivery times, not our own uplink model.

A node queues tensors on its FIFO uplink; each receipt ack comes back one latency after the last
byte arrived. The sample of a tensor must be its size over the time it really held the uplink,
whatever the node's (possibly wrong) estimate says, so a wrong estimate converges to the truth
instead of feeding its error back into the next samples.
"""

from __future__ import annotations

import random

import pytest
from tests.unit.protocol.core_harness import TRAIN

from gwtf.config import ProtocolConfig
from gwtf.protocol.core import NodeCore
from gwtf.protocol.router import LinkEstimate, PeerInfo

LAT = 0.01
TRUE_BW = 100e6
SIZE = 25_000_000  # 0.25 s on the true link


def _core(start_bw: float) -> NodeCore:
    me = PeerInfo(id="a0", stage=1, region="r", compute_s=0.1, capacity=4)
    core = NodeCore(me, ProtocolConfig(), TRAIN, random.Random(1))
    for p in ("b0", "b1"):
        core.links[p] = LinkEstimate(latency_s=LAT, bandwidth_bytes_per_s=start_bw)
    return core


def _fifo_acks(sends: list[tuple[float, str]]) -> list[tuple[float, float, str]]:
    """(sent_at, ack_at, peer) of tensors sent in this order on a FIFO uplink at TRUE_BW."""
    free, out = 0.0, []
    for sent_at, peer in sends:
        done = max(free, sent_at) + SIZE / TRUE_BW
        free = done
        out.append((sent_at, done + 2 * LAT, peer))
    return out


@pytest.mark.parametrize("start_bw", [500e6, 20e6])
def test_a_wrong_estimate_converges_on_back_to_back_sends(start_bw: float) -> None:
    core = _core(start_bw)
    sends = [(0.0, "b0"), (0.0, "b0"), (0.1, "b0"), (0.2, "b0"), (2.0, "b0")]
    for sent_at, _ in sends:
        core.reserve_uplink("b0", SIZE, sent_at)
    a = core.cfg.ema_alpha
    expect = start_bw
    for sent_at, ack_at, peer in _fifo_acks(sends):
        core.observe_transfer(peer, SIZE, sent_at, ack_at)
        expect = (1 - a) * expect + a * TRUE_BW  # every sample is the true bandwidth
        assert core.links[peer].bandwidth_bytes_per_s == pytest.approx(expect, rel=1e-9)


def test_no_sample_behind_a_tensor_nothing_acks() -> None:
    from gwtf.protocol.messages import GradShare

    core = _core(TRUE_BW)
    share = GradShare(iteration=0, round=0, key=("g", "a0", 0, 0, "a0", 0), count=1, size_bytes=SIZE)
    core.send_booked("b1", share, 0.0)  # holds the uplink until ~0.25 s; no ack will tell us when
    core.reserve_uplink("b0", SIZE, 0.0)
    core.links["b0"] = LinkEstimate(latency_s=LAT, bandwidth_bytes_per_s=TRUE_BW / 2)
    # the activation queued behind the share: its round trip includes the share's transfer
    core.observe_transfer("b0", SIZE, 0.0, 0.5 + 2 * LAT)
    assert core.links["b0"].bandwidth_bytes_per_s == TRUE_BW / 2  # no sample taken
    # a tensor sent once the share is surely gone is measured again
    core.observe_transfer("b0", SIZE, 1.0, 1.0 + 0.25 + 2 * LAT)
    assert core.links["b0"].bandwidth_bytes_per_s > TRUE_BW / 2


def test_an_ack_after_the_ack_of_a_later_send_gives_no_sample() -> None:
    core = _core(TRUE_BW)
    (s0, ack0, _), (s1, ack1, _) = _fifo_acks([(0.0, "b0"), (0.05, "b1")])
    core.observe_transfer("b1", SIZE, s1, ack1)  # the second tensor's ack comes first
    before = core.links["b0"].bandwidth_bytes_per_s
    # the first one's ack, delayed past it: taken at face value it would say 0.001 s, 25 GB/s
    core.observe_transfer("b0", SIZE, s0, ack1 + 0.001)
    assert core.links["b0"].bandwidth_bytes_per_s == before
    # and an ack that came early through a shorter path (done before the last measured) neither
    core.observe_transfer("b0", SIZE, s0, ack0)
    assert core.links["b0"].bandwidth_bytes_per_s == before


def test_the_router_hears_a_link_change_at_the_current_time() -> None:
    """A moved estimate reaches the router with `now` (it once got the tensor's round trip, and
    the flow agent then ran, and scheduled its timers, on a clock of a fraction of a second)."""
    from gwtf.protocol.base import SetTimer

    core = _core(20e6)  # 5x too low: the first sample moves the estimate by far more than 20%
    sent_at = 500.0
    core.reserve_uplink("b0", SIZE, sent_at)
    ack_at = sent_at + SIZE / TRUE_BW + 2 * LAT
    effects = core.observe_transfer("b0", SIZE, sent_at, ack_at)
    assert core.links["b0"].bandwidth_bytes_per_s > 1.2 * 20e6
    assert core.router.state.now == ack_at  # type: ignore[attr-defined]
    assert all(e.at >= ack_at for e in effects if isinstance(e, SetTimer))
