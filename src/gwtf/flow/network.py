"""Region-to-region network data: one-way latency and bandwidth between world regions.

Owns: the `Network` value type and `load_network(name)`, which reads the tables shipped in
`gwtf/resources/` (geo10: the 10-region AWS table; geo12: the 12-location table; see PAPER.md 6.4
for sources). Same-region links default to 10 ms one-way and 2 Gbit/s.

Units: latency in seconds (one-way), bandwidth in bytes per second. The TOML files keep the units
of their source (ms; Gbit/s or GiB/s) and name them; `load_network` converts. `perturb_network`
applies seeded multiplicative per-link noise (link heterogeneity / instability).

It also owns the one message delay model both drivers use (`uplink_send`, `CONTROL_BYTES`): a
message leaves its sender's uplink after every bulk message queued before it, takes
(payload + header) / bandwidth to serialise and arrives one latency later; a control message
(no payload) interleaves with bulk transfers at packet level and waits for none. The simulator's
`sim.models.NetworkModel` applies it per node, the runtime's WAN emulation
(`runtime.clock.WanModel`) to its own node's uplink.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import random
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from gwtf.errors import UserError

SAME_REGION_LATENCY_S = 0.010
SAME_REGION_BANDWIDTH_BYTES_PER_S = 2e9 / 8
KNOWN_NETWORKS = ("geo10", "geo12")
CONTROL_BYTES = 256
"""Header bytes of every message (its fields; a tensor's bytes are its payload)."""
_BYTES_PER_S = {"Gbit/s": 1e9 / 8, "GiB/s": float(1024**3), "GB/s": 1e9, "Mbit/s": 1e6 / 8}


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


def load_network(name: str) -> Network:
    """Read a shipped region table (`geo10`, `geo12`) and convert to seconds and bytes/s.

    Raises:
        UserError: unknown name.
    """
    if name not in KNOWN_NETWORKS:
        raise UserError(f"unknown network {name!r} (known: {', '.join(KNOWN_NETWORKS)})")
    text = resources.files("gwtf").joinpath("resources", f"{name}.toml").read_text(encoding="utf-8")
    return network_from_dict(name, tomllib.loads(text))


def network_from_dict(name: str, data: dict[str, Any]) -> Network:
    """Build a `Network` from the parsed TOML layout of `gwtf/resources/geo*.toml`."""
    regions = tuple(str(r) for r in data["regions"])
    if data["latency_unit"] != "ms":
        raise UserError(f"network {name!r}: latency_unit must be 'ms', got {data['latency_unit']!r}")
    unit = data["bandwidth_unit"]
    if unit not in _BYTES_PER_S:
        raise UserError(f"network {name!r}: bandwidth_unit {unit!r} unknown (known: {sorted(_BYTES_PER_S)})")
    scale_bps = _BYTES_PER_S[unit]
    n = len(regions)
    pos = {r: k for k, r in enumerate(regions)}
    same_lat_s = float(data["same_region_latency_ms"]) / 1e3
    same_bw = float(data["same_region_bandwidth_gbit_s"]) * _BYTES_PER_S["Gbit/s"]
    lat: list[list[float | None]] = [[same_lat_s if a == b else None for b in range(n)] for a in range(n)]
    bw: list[list[float | None]] = [[same_bw if a == b else None for b in range(n)] for a in range(n)]
    for src, dst, lat_ms, bandwidth in data["links"]:
        if src not in pos or dst not in pos:
            raise UserError(f"network {name!r}: link {src}-{dst} names an unknown region")
        pairs = [(pos[src], pos[dst])]
        if data.get("symmetric", False):
            pairs.append((pos[dst], pos[src]))
        for a, b in pairs:
            lat[a][b] = float(lat_ms) / 1e3
            bw[a][b] = float(bandwidth) * scale_bps
    missing = [(regions[a], regions[b]) for a in range(n) for b in range(n) if lat[a][b] is None]
    if missing:
        raise UserError(f"network {name!r}: no link for {missing[0][0]}-{missing[0][1]}")
    return Network(
        name=name,
        regions=regions,
        latency_matrix_s=tuple(tuple(float(x or 0.0) for x in row) for row in lat),
        bandwidth_matrix_bytes_per_s=tuple(tuple(float(x or 0.0) for x in row) for row in bw),
        source=str(data.get("source", f"gwtf/resources/{name}.toml")),
    )


def perturb_network(net: Network, rng: random.Random, jitter_fraction: float) -> Network:
    """Seeded per-link multiplicative noise: every directed entry x becomes x * U(1-j, 1+j).

    Latency and bandwidth draw independently. `jitter_fraction` must be in [0, 1).
    """
    if not 0.0 <= jitter_fraction < 1.0:
        raise UserError(f"jitter_fraction must be in [0, 1), got {jitter_fraction}")

    def noisy(matrix: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(x * rng.uniform(1.0 - jitter_fraction, 1.0 + jitter_fraction) for x in row)
            for row in matrix
        )

    return replace(
        net,
        latency_matrix_s=noisy(net.latency_matrix_s),
        bandwidth_matrix_bytes_per_s=noisy(net.bandwidth_matrix_bytes_per_s),
        source=f"{net.source} (perturbed, jitter {jitter_fraction})",
    )


def uplink_send(free_s: float, now: float, latency_s: float, bandwidth_bytes_per_s: float, payload_bytes: int,
                control_bytes: int = CONTROL_BYTES) -> tuple[float, float, float]:
    """One message on a sender's uplink that is busy until `free_s`: (the uplink's new free time,
    the time its last byte leaves, its arrival time). A control message (`payload_bytes` 0)
    neither waits for nor delays the bulk queue."""
    if payload_bytes == 0:
        done = now + control_bytes / bandwidth_bytes_per_s
        return free_s, done, done + latency_s
    start = free_s if free_s > now else now
    done = start + (payload_bytes + control_bytes) / bandwidth_bytes_per_s
    return done, done, done + latency_s
