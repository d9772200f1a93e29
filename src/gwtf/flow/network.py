"""Region-to-region network data: one-way latency and bandwidth between world regions.

Owns: the `Network` value type and `load_network(name)`, which reads the tables shipped in
`gwtf/resources/` (geo10: the 10-region AWS table; geo12: the 12-location table; see PAPER.md 6.4
for sources). Same-region links default to 10 ms one-way and 2 Gbit/s.

Units: latency in seconds (one-way), bandwidth in bytes per second.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from dataclasses import dataclass

SAME_REGION_LATENCY_S = 0.010
SAME_REGION_BANDWIDTH_BYTES_PER_S = 2e9 / 8


@dataclass(frozen=True, slots=True)
class Network:
    """Latency and bandwidth between regions (matrices indexed by region position)."""

    name: str
    regions: tuple[str, ...]
    latency_matrix_s: tuple[tuple[float, ...], ...]  # [a][b] one-way seconds
    bandwidth_matrix_bytes_per_s: tuple[tuple[float, ...], ...]  # [a][b] bytes/s
    source: str = ""

    def index(self, region: str) -> int:
        return self.regions.index(region)

    def latency_s(self, a: str, b: str) -> float:
        return self.latency_matrix_s[self.index(a)][self.index(b)]

    def bandwidth_bytes_per_s(self, a: str, b: str) -> float:
        return self.bandwidth_matrix_bytes_per_s[self.index(a)][self.index(b)]
