"""The one fault grammar: what the simulator, the tensor simulation and a real node's chaos
injection break, and when (docs/faults.md is the user's reference).

Owns: `Fault` (one scripted fault: an action and a trigger, with optional filters), its two
written forms (a TOML table with the dataclass's own keys, as in a scenario's `[[faults]]`, and the
compact string `<action>:<trigger>[:key=value...]`, as in `runtime.fault`): `parse_fault`,
`Fault.spec` and `Fault.table` (each form parses back to an equal `Fault`); `FaultError` (one
line naming the bad part; a `UserError`, so the CLI exits 2, and a `ValueError`); `require`
(which actions/triggers a driver carries out), `check_role` (a fault its node's role can never
fire: a compute kind only the other role runs) and `FaultWatch`, the matcher every driver feeds
so the trigger semantics are the same everywhere.

Trigger semantics (`FaultWatch`):
- `time`: at `time_s` seconds of the driver's clock (the simulator's virtual time; a node
  process: seconds since it started).
- `record` (`after_event`): right after the `count`-th Record named `after_event` ("any": every
  record) that passes every filter; `compute` (`after_compute`): when the `count`-th Compute of
  kind `after_compute` ("aggregate": export_grad, reduce, concat or step; "any": every kind) that passes
  every filter is issued (the job is lost with a crash).
- count semantics: matches are counted per fault, over every node the driver feeds (a real node
  feeds only its own); the fault fires exactly once, on match number `count` (>= 1), and never
  again. (The runtime's old `after=C`, "skip C matches", is `count=C+1`.)
- filters (all must hold): `node` (the point's node; "" = any, and the fault hits the node whose
  point fired it), `iteration` / `from_iteration` (the point's iteration equals / is >= it),
  `mb` (its microbatch index), `stage` (its stage; for `crash_stage` `stage` names the stage to
  crash instead). A point that does not carry a filtered field does not match. -1 = no filter.

Pure: no I/O, clocks or randomness. Must not import torch, asyncio, socket, threading, time,
sim or runtime.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, NamedTuple, get_args

from gwtf.config import from_dict
from gwtf.errors import UserError
from gwtf.protocol.kinds import RELAY_KINDS, STAGE0_KINDS, ComputeKind, RecordName
from gwtf.protocol.messages import Compute

Action = Literal["crash", "leave", "join", "cut", "degrade", "crash_stage", "flip"]
ACTIONS: tuple[str, ...] = get_args(Action)
TRIGGERS = ("time", "record", "compute")
ANY = "any"
COMPUTE_GROUPS: dict[str, frozenset[ComputeKind]] = {
    "aggregate": frozenset({ComputeKind.EXPORT_GRAD, ComputeKind.REDUCE, ComputeKind.CONCAT,
                            ComputeKind.STEP}),
}
RECORD_NAMES = frozenset(r.value for r in RecordName) | {ANY}
COMPUTE_NAMES = frozenset(k.value for k in ComputeKind) | set(COMPUTE_GROUPS) | {ANY}

# compact form: key -> Fault field (the trigger keys first); `spec()` writes the first name of each
_TRIGGER_KEYS = {"t": "time_s", "time_s": "time_s", "after": "after_event", "after_event": "after_event",
                 "compute": "after_compute", "after_compute": "after_compute"}
_FILTER_KEYS = {"node": "node", "peer": "peer", "stage": "stage", "count": "count", "duration_s": "duration_s",
                "iter": "iteration", "iteration": "iteration", "from": "from_iteration",
                "from_iteration": "from_iteration", "mb": "mb"}
_SHORT = {"time_s": "t", "after_event": "after", "after_compute": "compute", "iteration": "iter",
          "from_iteration": "from"}
_INTS = frozenset({"stage", "count", "iteration", "from_iteration", "mb"})
_FLOATS = frozenset({"time_s", "duration_s"})
GRAMMAR = "<action>:<trigger>[:key=value...] (trigger: t=SECONDS, after=RECORD or compute=KIND)"


class FaultError(UserError, ValueError):
    """A malformed fault: one line naming the bad part (the CLI prints it and exits 2)."""


def _req(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise FaultError(f"faults.{key} {why}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One scripted fault: `event` (the action) fires on a time or protocol-point trigger.

    The field names are the TOML table's keys (a scenario's `[[faults]]`); the module docstring
    and docs/faults.md give the trigger and count semantics.
    """

    event: Action  # crash | leave | join | cut | degrade | crash_stage | flip
    time_s: float = 0.0  # time trigger: seconds (used when neither after_event nor after_compute is set)
    node: str = ""  # the node it hits / the point's node filter ("" = the node whose point fired it)
    peer: str = ""  # cut / degrade: the other end of the link
    stage: int = -1  # crash_stage: every replica of this stage; otherwise a filter on the point's stage
    after_event: str = ""  # record trigger: a RecordName, or "any"
    after_compute: str = ""  # compute trigger: a ComputeKind, "aggregate" or "any"
    count: int = 1  # fire on the count-th matching point (>= 1)
    duration_s: float = 30.0  # cut / degrade: how long the link window lasts
    iteration: int = -1  # filter: the point's iteration (-1 = any)
    from_iteration: int = -1  # filter: the point's iteration >= this (-1 = any)
    mb: int = -1  # filter: the point's microbatch index within its data holder's iteration (-1 = any)

    def __post_init__(self) -> None:
        _req(self.event in ACTIONS, "event", f"must be one of {', '.join(ACTIONS)}, got {self.event!r}")
        _req(math.isfinite(self.time_s) and self.time_s >= 0, "time_s", "must be >= 0")
        _req(self.count >= 1, "count", "must be >= 1")
        _req(math.isfinite(self.duration_s) and self.duration_s > 0, "duration_s", "must be > 0")
        _req(not (self.after_event and self.after_compute), "after_compute",
             "and faults.after_event are two triggers: set one")
        _req(self.time_s == 0 or not (self.after_event or self.after_compute), "time_s",
             "is a third trigger: a fault with after_event / after_compute has no time_s")
        _req(not self.after_event or self.after_event in RECORD_NAMES, "after_event",
             f"{self.after_event!r} is not a record name (RecordName, or 'any')")
        _req(not self.after_compute or self.after_compute in COMPUTE_NAMES, "after_compute",
             f"{self.after_compute!r} is not a compute kind (ComputeKind, 'aggregate' or 'any')")
        _req(self.event not in ("cut", "degrade") or bool(self.peer), "peer",
             f"is needed by {self.event} (the other end of the link)")
        _req(self.event != "crash_stage" or self.stage >= 0, "stage", "is needed by crash_stage (>= 0)")
        for k, v in (("iteration", self.iteration), ("from_iteration", self.from_iteration), ("mb", self.mb),
                     ("stage", self.stage)):
            _req(v >= -1, k, "must be >= 0 (or -1 = any)")
        _req(":" not in self.node and ":" not in self.peer, "node", "and faults.peer must not contain ':'")

    @property
    def trigger(self) -> str:
        """"time", "record" or "compute"."""
        return "record" if self.after_event else "compute" if self.after_compute else "time"

    def table(self) -> dict[str, Any]:
        """The TOML table form: `event` and every key that differs from its default."""
        values = asdict(self)
        return {"event": self.event} | {f.name: values[f.name] for f in fields(self)
                                        if f.name != "event" and values[f.name] != f.default}

    def spec(self) -> str:
        """The compact form, `<action>:<trigger>[:key=value...]` (parses back to an equal Fault)."""
        trig = {"time": "time_s", "record": "after_event", "compute": "after_compute"}[self.trigger]
        table = self.table()
        first = {"time_s": f"t={self.time_s!r}", "after_event": f"after={self.after_event}",
                 "after_compute": f"compute={self.after_compute}"}[trig]
        parts = [self.event, first]
        for key, v in table.items():
            if key not in ("event", trig):
                parts.append(f"{_SHORT.get(key, key)}={v!r}" if key in _FLOATS else f"{_SHORT.get(key, key)}={v}")
        return ":".join(parts)


def parse_fault(value: str | Mapping[str, Any], where: str = "fault", prefix: str = "faults") -> Fault:
    """A Fault from its compact string or its TOML table (keys checked strictly, as config
    tables are, `prefix` naming the table); FaultError (one line, naming `where` and the bad part)
    otherwise."""
    if isinstance(value, Mapping):
        try:
            return from_dict(Fault, dict(value), prefix=prefix)
        except UserError as e:  # FaultError included
            raise FaultError(f"{where}: {str(e).removeprefix('config: ')}") from None
    if not isinstance(value, str):
        raise FaultError(f"{where}: expected a string {GRAMMAR} or a table, got {type(value).__name__}")
    text = value.strip()
    head = f"{where} {text!r}"
    parts = text.split(":")
    if not text or len(parts) < 2:
        raise FaultError(f"{head}: expected {GRAMMAR}")
    action, trigger = parts[0], parts[1]
    if action not in ACTIONS:
        hint = " (the old kill: is crash:)" if action == "kill" else ""
        raise FaultError(f"{head}: unknown action {action!r}{hint}; one of {', '.join(ACTIONS)}")
    values: dict[str, Any] = {"event": action}
    key, sep, raw = trigger.partition("=")
    if not sep or key not in _TRIGGER_KEYS:
        hints = ([f"after={trigger} (a record)"] if trigger in RECORD_NAMES else []) + (
            [f"compute={trigger} (a compute job)"] if trigger in COMPUTE_NAMES else [])
        if hints:
            raise FaultError(f"{head}: trigger {trigger!r}: write {' or '.join(hints)}")
        raise FaultError(f"{head}: trigger {trigger!r}: expected t=SECONDS, after=RECORD or compute=KIND")
    values[_TRIGGER_KEYS[key]] = _value(head, key, _TRIGGER_KEYS[key], raw)
    for part in parts[2:]:
        key, sep, raw = part.partition("=")
        if sep and key in _TRIGGER_KEYS:
            hint = " (to skip matches use count=N: fires on the N-th)" if key == "after" else ""
            raise FaultError(f"{head}: {part!r} is a second trigger{hint}; the trigger is the 2nd part only")
        if not sep or key not in _FILTER_KEYS:
            raise FaultError(f"{head}: unknown key {part!r} (node, peer, stage, count, duration_s, iter, from, mb)")
        name = _FILTER_KEYS[key]
        if name in values:
            raise FaultError(f"{head}: {key} given twice")
        values[name] = _value(head, key, name, raw)
    try:
        return Fault(**values)
    except FaultError as e:
        raise FaultError(f"{head}: {str(e).removeprefix('faults.')}") from None


def _value(head: str, key: str, name: str, raw: str) -> Any:
    if name in _INTS:
        try:
            return int(raw)
        except ValueError:
            raise FaultError(f"{head}: {key} must be an integer, got {raw!r}") from None
    if name in _FLOATS:
        try:
            return float(raw)
        except ValueError:
            raise FaultError(f"{head}: {key} must be a number, got {raw!r}") from None
    if not raw:
        raise FaultError(f"{head}: {key} is empty")
    return raw


def require(fault: Fault, actions: Iterable[str], triggers: Iterable[str], where: str) -> None:
    """FaultError unless this driver (`where`) carries out the fault's action and trigger."""
    actions, triggers = tuple(actions), tuple(triggers)
    if fault.event not in actions:
        raise FaultError(f"{where}: action {fault.event!r} is not carried out here ({', '.join(actions)})")
    if fault.trigger not in triggers:
        raise FaultError(f"{where}: a {fault.trigger} trigger is not supported here ({', '.join(triggers)})")


ROLES = ("data-holder", "relay")
_ROLE_TEXT = {"data-holder": "a data holder (stage 0)", "relay": "a relay (a stage >= 1)"}
_PLURAL = {"data-holder": "data holders", "relay": "relays"}
_ONLY = {"data-holder": STAGE0_KINDS, "relay": RELAY_KINDS}  # the kinds only this role runs


def check_role(fault: Fault, role: str, where: str, stages: int = 0) -> None:
    """FaultError (one line, naming `where`, the kind and the role) when `fault`, carried by a
    node of `role`, can never fire there: its compute trigger names a kind only the other role
    runs (`kinds.STAGE0_KINDS`, `kinds.RELAY_KINDS`; "aggregate" and "any" run everywhere), or
    its `stage` filter (not crash_stage's target) names a stage no compute job of that role
    carries (a job's stage is its node's: 0 for a data holder; 1..stages-1 for a relay, which
    may move between them; `stages` = 0: not checked above 1). Record and time triggers are not
    checked. A driver calls it where it knows the node's role: `gwtf swarm --fault`, `gwtf
    node`, a scenario fault naming an initial node."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} ({', '.join(ROLES)})")
    if not fault.after_compute:
        return
    other = ROLES[1 - ROLES.index(role)]
    if fault.after_compute in _ONLY[other]:
        runs = [k.value for k in ComputeKind if k not in _ONLY[other]]
        raise FaultError(f"{where}: {_ROLE_TEXT[role]} never runs compute kind {fault.after_compute!r} "
                         f"(only {_PLURAL[other]} do), so this fault would never fire; {_PLURAL[role]} run "
                         f"{', '.join(runs)} (or use {', '.join(COMPUTE_GROUPS)}, {ANY})")
    if fault.stage < 0 or fault.event == "crash_stage":
        return
    never = fault.stage != 0 if role == "data-holder" else (fault.stage == 0 or 0 < stages <= fault.stage)
    if never:
        at = "stage 0" if role == "data-holder" else f"stages 1..{stages - 1}" if stages else "stages >= 1"
        raise FaultError(f"{where}: stage={fault.stage} never matches a compute job of a {_PLURAL[role][:-1]}: "
                         f"its jobs are at {at}, so this fault would never fire")


class Firing(NamedTuple):
    """A fault that fires: at `node`, on the point it matched (for logs: name, iteration, mb, stage)."""

    fault: Fault
    node: str
    point: str  # the record name / compute kind ("" for a time trigger)
    iteration: int | None = None
    mb: int | None = None
    stage: int | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def record_point(fields: Mapping[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(iteration, microbatch index, stage) of a record's fields: `iteration`, else its `mb`'s
    iteration; `index`, else its `mb`'s index; `stage`."""
    mb = fields.get("mb")
    mbt = mb if isinstance(mb, tuple) and len(mb) == 3 else None
    it = _int(fields.get("iteration"))
    if it is None and mbt is not None:
        it = _int(mbt[1])
    idx = _int(fields.get("index"))
    if idx is None and mbt is not None:
        idx = _int(mbt[2])
    return it, idx, _int(fields.get("stage"))


def compute_point(job: Compute) -> tuple[int | None, int | None, int]:
    """(iteration, microbatch index, stage) of a compute job: its microbatch's, else the
    iteration named by its last tensor key that carries one."""
    if job.mb is not None:
        return int(job.mb[1]), int(job.mb[2]), job.stage
    it = None
    for key in job.inputs + job.outputs:
        if len(key) > 2 and isinstance(key[2], int):
            it = int(key[2])
    return it, None, job.stage


class FaultWatch:
    """Says which faults fire, fed the points a driver sees (see the module docstring).

    `timed`: the time-triggered faults, in order (an event-driven driver schedules them itself);
    `due(now)`: the time faults not yet fired whose time has come (a polling driver);
    `on_record(name, node, fields)` / `on_compute(job, node)`: the point faults that fire on this
    point, in the order given. `fired` lists every Firing so far.
    """

    __slots__ = ("faults", "timed", "records", "computes", "_seen", "_done", "fired")

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults = tuple(faults)
        self.timed = tuple(f for f in self.faults if f.trigger == "time")
        self.records = tuple(i for i, f in enumerate(self.faults) if f.trigger == "record")
        self.computes = tuple(i for i, f in enumerate(self.faults) if f.trigger == "compute")
        self._seen = [0] * len(self.faults)
        self._done = [False] * len(self.faults)
        self.fired: list[Firing] = []

    def seen(self, index: int) -> int:
        """Matches counted so far by fault number `index` (of `faults`)."""
        return self._seen[index]

    def due(self, now: float) -> list[Firing]:
        out = []
        for i, f in enumerate(self.faults):
            if f.trigger == "time" and not self._done[i] and f.time_s <= now:
                self._done[i] = True
                out.append(Firing(f, f.node, ""))
        self.fired += out
        return out

    def on_record(self, name: str, node: str, fields: Mapping[str, Any]) -> list[Firing]:
        if not self.records:
            return []
        return self._match(self.records, name, None, node, fields, None)

    def on_compute(self, job: Compute, node: str) -> list[Firing]:
        if not self.computes:
            return []
        return self._match(self.computes, job.kind, job.kind, node, None, job)

    def _match(self, which: tuple[int, ...], name: str, kind: ComputeKind | None, node: str,
               fields: Mapping[str, Any] | None, job: Compute | None) -> list[Firing]:
        out: list[Firing] = []
        point: tuple[int | None, int | None, int | None] | None = None
        for i in which:
            f = self.faults[i]
            if self._done[i]:
                continue
            want = f.after_event if kind is None else f.after_compute
            if want != ANY and want != name and not (kind is not None and kind in COMPUTE_GROUPS.get(want, ())):
                continue
            if f.node and f.node != node:
                continue
            if point is None:
                point = record_point(fields or {}) if job is None else compute_point(job)
            it, mb, stage = point
            if ((f.iteration >= 0 and it != f.iteration)
                    or (f.from_iteration >= 0 and (it is None or it < f.from_iteration))
                    or (f.mb >= 0 and mb != f.mb)
                    or (f.stage >= 0 and f.event != "crash_stage" and stage != f.stage)):
                continue
            self._seen[i] += 1
            if self._seen[i] == f.count:
                self._done[i] = True
                out.append(Firing(f, f.node or node, str(name), it, mb, stage))
        self.fired += out
        return out
