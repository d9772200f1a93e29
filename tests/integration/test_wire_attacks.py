"""The encrypted wire under attack, in a real training swarm (issue 14; docs/security.md).

Four node processes on loopback (dh0, dh1; relays r1a, r1b of stage 1 of 2), the short timeouts
of configs/swarm-test.toml:
- a relay flips one ciphertext bit of a tensor frame it sends (`flip:` fault, runtime/chaos.py):
  the receiver refuses the frame and closes that connection with a warning naming the peer, the
  lost activation or gradient is recovered, and the run finishes with the exactly-once audit clean;
- 1,000 unauthenticated TCP connections to the leader at once (held open, some sending junk):
  the swarm still finishes its iterations and the audit stays clean.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Callable

import pytest

from gwtf.runtime.swarm import Swarm

ITERATIONS = 8
OVERRIDES = ("model.stages=2", f"train.iterations={ITERATIONS}")
SPREAD = ('protocol.router="greedy"',)  # both relays carry traffic (test_chaos.py says why)
FLOOD = 1000
FLOOD_ITERATIONS = 30


def _node(swarm: Swarm, name: str):  # noqa: ANN202 - launcher.NodeProcess
    return next(p for p in swarm.group.procs if p.name == name)


def _log(swarm: Swarm, name: str) -> str:
    return _node(swarm, name).log_tail(2_000_000)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_flipped_bit_in_a_tensor_frame_closes_that_connection_and_training_finishes(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]],
) -> None:
    swarm = make_swarm(OVERRIDES + SPREAD, faults={"r1a": "flip:compute=forward:from=2"})
    swarm.start()
    totals = finish(swarm, ITERATIONS, 120.0)
    fired = [r for r in swarm.metrics.records.get("r1a", []) if r.get("event") == "fault"]
    assert len(fired) == 1 and fired[0]["point"] == "forward", fired
    victim_id = _node(swarm, "r1a").node_id
    refusals = [line for p in swarm.group.procs if p.name != "r1a" for line in _log(swarm, p.name).splitlines()
                if "dropped peer" in line and victim_id in line]
    assert refusals, "no receiver logged the corrupted frame with the sender's id"
    assert _node(swarm, "r1a").alive() or _node(swarm, "r1a").popen.poll() == 0
    assert totals["expected"] == 4 * ITERATIONS * 2 and totals["dropped"] == 0


class _Flood:
    """`n` unauthenticated connections to `addr`, held open from a thread and reopened as the
    node drops them (its caps drop the oldest), a third of them sending a frame prefix that
    announces a 1 MiB header and a 256 MiB body; `stop()` closes them all."""

    def __init__(self, addr: str, n: int) -> None:
        host, _, port = addr.rpartition(":")
        self.target = (host, int(port))
        self.n = n
        self.opened = 0
        self.reopened = 0
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def start(self) -> None:
        self._socks = [self._open(i) for i in range(self.n)]
        self._thread.start()

    def _open(self, i: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(self.target)
        self.opened += 1
        if i % 3 == 0:
            try:
                s.send(b"GWTF\x01\x00" + (1 << 20).to_bytes(4, "little") + (256 << 20).to_bytes(8, "little"))
            except OSError:
                pass
        return s

    def _run(self) -> None:
        while not self._stop.wait(0.05):  # the flood's own pace, not a synchronisation
            for i, s in enumerate(self._socks):
                try:
                    closed = s.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    s.close()
                    self._socks[i] = self._open(i)
                    self.reopened += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self._socks:
            s.close()


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_thousand_unauthenticated_connections_leave_the_swarm_training(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]],
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * FLOOD + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * FLOOD + 512), hard))
    swarm = make_swarm(("model.stages=2", f"train.iterations={FLOOD_ITERATIONS}"))
    swarm.start()
    assert swarm.run_until(2, 60.0), swarm.log_tails()
    flood = _Flood(_node(swarm, "dh0").addr, FLOOD)  # the leader
    flood.start()
    try:
        t0 = time.monotonic()
        totals = finish(swarm, FLOOD_ITERATIONS, 120.0)
        took = time.monotonic() - t0
    finally:
        flood.stop()
    assert flood.opened >= FLOOD
    assert totals["expected"] == 4 * FLOOD_ITERATIONS * 2 and totals["dropped"] == 0
    print(f"{FLOOD} unauthenticated connections held ({flood.reopened} reopened after the node dropped them): "
          f"iterations 2..{FLOOD_ITERATIONS} in {took:.1f}s")
