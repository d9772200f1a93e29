"""What a person watching a swarm sees: a node's own counters and progress line, and the
swarm-wide header above the live table.

Owns:
- `NodeStats`: the counters a node publishes in its status.json (`iteration`, `last_loss`,
  `tokens_per_s`, `iteration_s`, `microbatches` served, `crashes_seen`, `joins_seen`), kept from
  its own records. `tokens_per_s` / `iteration_s` are the driver's `stepped` record's (tokens this
  node computed between two of its optimizer steps, and the seconds between them). Crashes and
  joins are swarm events as this node saw them: a non-graceful eviction it decided or the loss of
  its leader (a crash), a joiner admitted after training started (a join). Only the leader
  decides evictions and admissions, so its counts are the swarm's; a node's own join is not one.
- `progress_line`: the line `gwtf node` prints every `runtime.progress_every` iterations.
- `swarm_header` / `header_text`: iteration X/K, ETA, loss, tokens/s, members by stage, crashes
  and joins, computed from status rows (any source: the local launcher's status files, or the
  rows a member returned to `gwtf status`); a local launcher passes its own crash/join counts.
- `render_watch`: the header line above `status.render_table`, what `gwtf swarm`, `gwtf demo`
  and `gwtf status` print; `print_full_width` prints it to a pipe or a file uncut (rich draws
  80 columns there, which cut the table's columns to `sta…`).
- `member_snapshot` / `member_lines`: the lines `gwtf node` prints when a member leaves or joins
  its directory (`member r1a (stage 1) lost; 5 members`).

Must not import torch or asyncio.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.text import Text

from gwtf.protocol.kinds import RecordName
from gwtf.runtime.status import render_table

__all__ = [
    "NodeStats", "format_eta", "header_text", "member_line", "member_lines", "member_snapshot",
    "print_full_width", "progress_line", "render_watch", "swarm_header",
]

LIVE_STATES = frozenset({"active"})  # a row in this state counts as a member serving its stage
FULL_WIDTH_MAX = 10_000  # columns a renderable may ask for on a console that is no terminal


@dataclass(slots=True)
class NodeStats:
    """A node's counters, from its own records (see the module docstring)."""

    iteration: int | None = None  # the last iteration this node stepped (0-based)
    last_loss: float | None = None  # data holders: the last microbatch loss
    tokens_per_s: float | None = None  # tokens this node computed per second in its last iteration
    iteration_s: float | None = None  # seconds between its last two optimizer steps
    microbatches: int = 0  # microbatches it served (contributed to its stage's update)
    crashes_seen: int = 0
    joins_seen: int = 0
    started: bool = False  # the leader started iteration 0 (joins before that form the swarm)

    def absorb(self, event: str, fields: Mapping[str, Any]) -> bool:
        """Count one record; True when it is this node's optimizer step (`stepped`)."""
        if event == RecordName.LOSS:
            loss = fields.get("loss")
            self.last_loss = float(loss) if isinstance(loss, (int, float)) else self.last_loss
        elif event == RecordName.STEPPED:
            it = fields.get("iteration")
            self.iteration = it if isinstance(it, int) else self.iteration
            self.tokens_per_s = _number(fields.get("tokens_per_s"), self.tokens_per_s)
            self.iteration_s = _number(fields.get("iteration_s"), self.iteration_s)
            return True
        elif event == RecordName.CONTRIBUTE:
            self.microbatches += 1
        elif event == RecordName.ITER_START:
            self.started = True
        elif event == RecordName.EVICT and not fields.get("graceful"):
            self.crashes_seen += 1
        elif event == RecordName.LEADER_LOST:
            self.crashes_seen += 1
        elif event == RecordName.JOIN and (self.started or self.iteration is not None):
            self.joins_seen += 1
        return False

    def as_status(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("started")
        return out


def _number(value: Any, default: float | None) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def progress_line(name: str, stage: int | None, stats: NodeStats, iterations: int, members: int,
                  state: str) -> str:
    """`progress: NAME stage K iteration X/N loss L tokens/s T members M microbatches S state X`."""
    step = f"{stats.iteration + 1}/{iterations}" if stats.iteration is not None else "-"
    loss = f"{stats.last_loss:.4f}" if stats.last_loss is not None else "-"
    rate = f"{stats.tokens_per_s:.0f}" if stats.tokens_per_s is not None else "-"
    took = f"{stats.iteration_s:.3f}s" if stats.iteration_s is not None else "-"
    return (f"progress: {name} stage {'-' if stage is None else stage} iteration {step} loss {loss} "
            f"tokens/s {rate} iteration_s {took} members {members} microbatches {stats.microbatches} "
            f"state {state}")


def should_print_progress(iteration: int, iterations: int, every: int) -> bool:
    """Every `every` iterations (0: never), the first and the last."""
    if every <= 0:
        return False
    done = iteration + 1
    return done == 1 or done % every == 0 or done >= iterations


def format_eta(seconds: float | None) -> str:
    """"1h02m", "3m05s", "42s"; "-" when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _floats(rows: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    out = []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def swarm_header(rows: Sequence[Mapping[str, Any]], iterations: int | None = None,
                 crashes: int | None = None, joins: int | None = None) -> dict[str, Any]:
    """The swarm-wide numbers of the live table's header, from status rows.

    iteration: iterations completed (the furthest step any live row logged, + 1); iterations: K
    (the argument, else the rows' `iterations`); eta_s: (K - done) x the median iteration time
    of the live data holders; loss: the mean last loss of the live data holders; tokens_per_s:
    the sum of theirs (the tokens trained per second); members: live rows per stage; crashes,
    joins: the arguments, else the most any row saw (the leader's counts).
    """
    live = [r for r in rows if r.get("state") in LIVE_STATES]
    holders = [r for r in live if r.get("role") == "data-holder" or r.get("stage") == 0]
    steps = [int(r["iteration"]) for r in live if isinstance(r.get("iteration"), int)]
    done = max(steps) + 1 if steps else 0
    total = iterations if iterations is not None else max((int(r["iterations"]) for r in rows
                                                           if isinstance(r.get("iterations"), int)), default=0)
    took = _floats(holders, "iteration_s") or _floats(live, "iteration_s")
    eta = (max(0, total - done) * statistics.median(took)) if took and total else None
    losses = _floats(holders, "last_loss")
    rates = _floats(holders, "tokens_per_s")
    members: dict[int, int] = {}
    for r in live:
        if isinstance(r.get("stage"), int):
            members[r["stage"]] = members.get(r["stage"], 0) + 1
    seen_crashes = max((int(r.get("crashes_seen") or 0) for r in rows), default=0)
    seen_joins = max((int(r.get("joins_seen") or 0) for r in rows), default=0)
    return {
        "iteration": done, "iterations": total, "eta_s": eta,
        "loss": sum(losses) / len(losses) if losses else None,
        "tokens_per_s": sum(rates) if rates else None,
        "members": dict(sorted(members.items())),
        "crashes": seen_crashes if crashes is None else crashes,
        "joins": seen_joins if joins is None else joins,
    }


def header_text(header: Mapping[str, Any]) -> str:
    """One line: `iteration 12/300 | ETA 3m05s | loss 4.1234 | 2345 tokens/s | members 0:2 1:2 | crashes 1 | joins 1`."""
    loss = header.get("loss")
    rate = header.get("tokens_per_s")
    members = " ".join(f"{k}:{n}" for k, n in header.get("members", {}).items()) or "-"
    return " | ".join((
        f"iteration {header.get('iteration', 0)}/{header.get('iterations') or '?'}",
        f"ETA {format_eta(header.get('eta_s'))}",
        f"loss {loss:.4f}" if isinstance(loss, float) else "loss -",
        f"{rate:.0f} tokens/s" if isinstance(rate, float) else "- tokens/s",
        f"members by stage {members}",
        f"crashes {header.get('crashes', 0)}",
        f"joins {header.get('joins', 0)}",
    ))


def render_watch(rows: Sequence[Mapping[str, Any]], title: str = "", stalled: Iterable[int] = (),
                 iterations: int | None = None, crashes: int | None = None, joins: int | None = None) -> Group:
    """The header line above the per-node table (`status.render_table`)."""
    header = header_text(swarm_header(rows, iterations, crashes, joins))
    return Group(Text(header, style="bold"), render_table(rows, title, stalled))


def print_full_width(console: Console, renderable: RenderableType) -> None:
    """Print `renderable`; on a console that is no terminal (a pipe, a file: rich assumes 80
    columns there, and the table cut its columns to `sta…`), first widen the console to what
    it needs, so every column and value comes out in full. A terminal keeps its own width."""
    if not console.is_terminal:
        needed = console.measure(renderable, options=console.options.update_width(FULL_WIDTH_MAX)).maximum
        console.width = max(console.width, needed)
    console.print(renderable)


MemberSnapshot = dict[str, tuple[int, int]]
"""Node id -> (stage, shard) of every member in a node's directory (shard -1: none)."""


def member_snapshot(directory: Mapping[str, Any]) -> MemberSnapshot:
    """The (stage, shard) of every entry of a core's directory (id -> `PeerInfo`)."""
    return {pid: (int(info.stage), int(info.shard)) for pid, info in directory.items()}


def member_line(node: str, stage: int, shard: int, change: str, members: int) -> str:
    """`member r1a (stage 1) lost; 5 members` or `member j0 (stage 0, data holder, shard 1)
    joined; 6 members`: the name part of a node id (`NAME~FINGERPRINT/REGION@HOST:PORT`)."""
    name = node.split("~", 1)[0].split("/", 1)[0].split("@", 1)[0] or node
    where = f"stage {stage}" if stage >= 0 else "no stage"
    if stage == 0:
        where += ", data holder" + (f", shard {shard}" if shard >= 0 else "")
    return f"member {name} ({where}) {change}; {members} member{'s' if members != 1 else ''}"


def member_lines(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]],
                 me: str) -> list[str]:
    """One `member_line` per member (other than `me`) that left the directory between two
    snapshots ("lost": crashed, left, evicted, or moved out of a relay's directory) and per one
    that entered it ("joined"), in id order, losses first; each line's count is the directory's
    size (this node included) once the changes up to that line are applied."""
    lost = sorted(set(before) - set(after) - {me})
    joined = sorted(set(after) - set(before) - {me})
    count, out = len(before), []
    for pid in lost:
        count -= 1
        out.append(member_line(pid, *before[pid], "lost", count))
    for pid in joined:
        count += 1
        out.append(member_line(pid, *after[pid], "joined", count))
    return out
