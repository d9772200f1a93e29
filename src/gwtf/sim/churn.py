"""Churn as data: crash / leave / join events and link instability windows.

Owns: `ChurnEvent`, `read_trace` (CSV `time_s,event,node`), `node_lifetime_events` (a node's
first crash or leave drawn from exponential clocks at the per-node hourly rates), `join_times`
(swarm-wide Poisson arrivals) and `link_windows` (instability windows on random live links).
All draws use the `random.Random` passed in.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from gwtf.errors import UserError
from gwtf.sim.models import LinkWindow
from gwtf.sim.scenario import ChurnSection, LinksSection

EVENTS = ("crash", "leave", "join")


@dataclass(frozen=True, slots=True)
class ChurnEvent:
    time_s: float
    event: str  # crash | leave | join
    node: str = ""  # join: "" (a fresh id is made)


def read_trace(path: str | Path) -> list[ChurnEvent]:
    """Read a churn trace; a malformed row is a UserError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"churn trace not found: {p}")
    out: list[ChurnEvent] = []
    with p.open(encoding="utf-8", newline="") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            if not row or row[0].startswith("#") or row[0] == "time_s":
                continue
            try:
                t, ev = float(row[0]), row[1].strip()
                node = row[2].strip() if len(row) > 2 else ""
            except (ValueError, IndexError):
                raise UserError(f"churn trace {p}:{lineno}: expected time_s,event,node") from None
            if ev not in EVENTS or t < 0:
                raise UserError(f"churn trace {p}:{lineno}: bad event {ev!r} or negative time")
            out.append(ChurnEvent(t, ev, node))
    return sorted(out, key=lambda e: (e.time_s, e.event, e.node))


def node_lifetime_event(cfg: ChurnSection, rng: random.Random, now: float) -> ChurnEvent | None:
    """When a node that starts now will crash or leave (whichever exponential clock rings first)."""
    rate_crash = cfg.crash_rate_per_hour / 3600.0
    rate_leave = cfg.leave_rate_per_hour / 3600.0
    total = rate_crash + rate_leave
    if total <= 0:
        return None
    t = now + rng.expovariate(total)
    event = "crash" if rng.random() * total < rate_crash else "leave"
    return ChurnEvent(t, event)


def join_times(cfg: ChurnSection, rng: random.Random, horizon_s: float) -> list[float]:
    rate = cfg.join_rate_per_hour / 3600.0
    out: list[float] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        out.append(t)
    return out


def link_windows(cfg: LinksSection, nodes: list[str], rng: random.Random, horizon_s: float) -> list[LinkWindow]:
    """Instability windows on random node pairs, Poisson in time."""
    rate = cfg.events_per_hour / 3600.0
    out: list[LinkWindow] = []
    t = 0.0
    while rate > 0 and len(nodes) >= 2:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        a, b = rng.sample(nodes, 2)
        cut = rng.random() < cfg.cut_fraction
        out.append(LinkWindow(a, b, t, t + cfg.duration_s, cfg.latency_factor, cfg.bandwidth_divisor, cut))
    return out
