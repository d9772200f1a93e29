"""Network and compute cost models of the simulator.

Owns:
- `NetworkModel`: delivery time of a tensor-carrying message from a to b = wait for a's uplink
  (a node's outgoing tensor bytes serialise on its uplink, FIFO) + bytes / bandwidth(a, b) +
  latency(a, b), from the Instance's region tables; control messages (no tensor) interleave at
  packet level and skip the queue; link instability windows (latency x factor, bandwidth /
  factor, or cut) apply at send time; with a downlink (`nodes.downlink_bytes_per_s` > 0) a
  tensor message then takes its turn on b's downlink, a FIFO: its bytes enter no earlier than
  its first byte arrives and after the message before it, take bytes / downlink, and the message
  arrives when both its link transfer and its downlink turn are done (0 = no downlink step);
- `ComputeModel`: one FIFO compute queue per node; duration = Compute.flops / node speed (speed
  = the stage's FLOPs per microbatch / the node's c_i) x seeded multiplicative jitter, or
  bytes / checkpoint bandwidth for state and checkpoint transfers.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gwtf.flow.network import Network, uplink_send


@dataclass(slots=True)
class LinkWindow:
    """Instability on the link a <-> b during [start_s, end_s)."""

    a: str
    b: str
    start_s: float
    end_s: float
    latency_factor: float = 1.0
    bandwidth_divisor: float = 1.0
    cut: bool = False


class NetworkModel:
    """Latency + serialisation on the sender's uplink (+ the receiver's downlink); instability windows."""

    def __init__(self, network: Network, control_bytes: int, downlink_bytes_per_s: float = 0.0) -> None:
        self.network = network
        self.control_bytes = control_bytes
        self.downlink_bytes_per_s = downlink_bytes_per_s
        self.region: dict[str, int] = {}
        self.uplink_free_s: dict[str, float] = {}
        self.downlink_free_s: dict[str, float] = {}
        self.windows: dict[tuple[str, str], list[LinkWindow]] = {}
        n = len(network.regions)
        self._lat = [[network.latency_matrix_s[i][j] for j in range(n)] for i in range(n)]
        self._bw = [[network.bandwidth_matrix_bytes_per_s[i][j] for j in range(n)] for i in range(n)]

    def add_node(self, node: str, region: str) -> None:
        self.region[node] = self.network.index(region)

    def add_window(self, w: LinkWindow) -> None:
        key = (w.a, w.b) if w.a < w.b else (w.b, w.a)
        self.windows.setdefault(key, []).append(w)

    def _window(self, a: str, b: str, now: float) -> LinkWindow | None:
        if not self.windows:
            return None
        ws = self.windows.get((a, b) if a < b else (b, a))
        if not ws:
            return None
        for w in ws:
            if w.start_s <= now < w.end_s:
                return w
        return None

    def base(self, a: str, b: str) -> tuple[float, float]:
        ra, rb = self.region[a], self.region[b]
        return self._lat[ra][rb], self._bw[ra][rb]

    def send(self, a: str, b: str, payload_bytes: int, now: float) -> tuple[float, float] | None:
        """(time the last byte leaves a's uplink, arrival time) or None if the link is cut."""
        region = self.region
        ra, rb = region[a], region[b]
        lat, bw = self._lat[ra][rb], self._bw[ra][rb]
        w = self._window(a, b, now) if self.windows else None
        if w is not None:
            if w.cut:
                return None
            lat *= w.latency_factor
            bw /= w.bandwidth_divisor
        if payload_bytes == 0:  # control: no uplink queue (flow.network.uplink_send)
            _, done, arrival = uplink_send(0.0, now, lat, bw, 0, self.control_bytes)
            return done, arrival
        free, done, arrival = uplink_send(self.uplink_free_s.get(a, now), now, lat, bw, payload_bytes,
                                          self.control_bytes)
        self.uplink_free_s[a] = free
        if self.downlink_bytes_per_s > 0:  # its first byte reached b one serialisation before the last
            size = payload_bytes + self.control_bytes
            arrival = self._downlink(b, size, arrival - size / bw, arrival)
        return done, arrival

    def _downlink(self, b: str, size_bytes: int, first_byte_s: float, link_arrival_s: float) -> float:
        """b's downlink FIFO: the message's turn starts when its first byte is in and the previous
        message's turn is over, and takes size / downlink; arrival = the later of its end and the
        link's own arrival."""
        start = max(first_byte_s, self.downlink_free_s.get(b, first_byte_s))
        end = start + size_bytes / self.downlink_bytes_per_s
        self.downlink_free_s[b] = end
        return max(end, link_arrival_s)


class ComputeModel:
    """One FIFO compute queue per node with seeded multiplicative jitter."""

    def __init__(self, rng: random.Random, jitter: float, checkpoint_bandwidth_bytes_per_s: float) -> None:
        self.rng = rng
        self.jitter = jitter
        self.checkpoint_bw = checkpoint_bandwidth_bytes_per_s
        self.busy_until_s: dict[str, float] = {}
        self.speed: dict[str, float] = {}

    def add_node(self, node: str, flops_per_s: float) -> None:
        self.speed[node] = flops_per_s

    def schedule(self, node: str, flops: float, size_bytes: int, now: float) -> tuple[float, float]:
        """(start, end) of a job queued now on `node`."""
        dur = flops / self.speed[node] if flops > 0 else 0.0
        if self.jitter > 0 and dur > 0:
            dur *= 1.0 + self.jitter * (2.0 * self.rng.random() - 1.0)
        if size_bytes > 0 and flops == 0:
            dur += size_bytes / self.checkpoint_bw
        start = self.busy_until_s.get(node, now)
        if start < now:
            start = now
        self.busy_until_s[node] = start + dur
        return start, start + dur
