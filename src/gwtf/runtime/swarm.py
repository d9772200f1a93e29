"""A local swarm: the node processes of one run, churn injected into them, metrics read back.

Owns: the initial node plan (data holders with their shards, R replicas of every relay stage),
the seeded churn schedule (`--churn low|high`: kill -9 of a random node at random moments, a
relay, a data holder or the leader alike unless `--churn-spare` spares some, each followed by a
joiner started through a random live peer: `Swarm.churn_victims`), the metrics of the whole
swarm (`DIR/metrics.jsonl`, same fields as `gwtf train --local` (loss, tokens, tokens_per_s, lr, grad_norms: one pre-clip norm per
stage, val_loss every `train.eval_every` iterations and at the last, from the checkpoints:
`runtime.validation`) plus crashes, joins, microbatches_redone (redo records: in flight and at
aggregation), microbatches_rerouted (forwards resent to another replica after a crash) and
microbatches_dropped),
`DIR/loss.png` and the live rich table (with the microbatches each node contributed and a line
per stage left without an active node). Processes are owned by a `ProcessGroup`, so every one is
killed on exit, error or Ctrl+C.

"crashes" counts every node process that died during the run, whatever killed it: `--churn`'s
kill -9 (counted as it is sent), and any node found dead that ended by itself with a signal or a
non-zero exit code (`crashed`): a scripted fault (`--fault`: the node SIGKILLs itself, after its
`fault` record), a kill from outside, an error, a node that gave up. Exit 0 (training finished, a
graceful leave) is no crash, nor are the kills of `close()`. Each node counts once.

"joins" counts joiners that SERVED: a joiner counts once its own records show it activated and
then contributed a microbatch (`served`); joiners started but not (yet) serving do not count.

A swarm iteration is complete when every data holder still running has logged its `stepped`
record for it (the driver's record of an optimizer step, with the new weights' hash); its loss is the mean of the `loss` records the data holders logged for it.

Must not import torch or asyncio.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gwtf.config import Config
from gwtf.protocol.kinds import RecordName
from gwtf.runtime.audit import audit_run, dropped_by
from gwtf.runtime.checkpoints import CHECKPOINTS_DIR, resume_version
from gwtf.runtime.launcher import NodePlan, NodeProcess, NodeStartError, ProcessGroup, mark_dead
from gwtf.runtime.status import RECORDS_FILE, STATUS_FILE, JsonlTail, read_status, stalled_stages

REDONE_EVENTS = frozenset({RecordName.REDO})  # the core's record of one redo (in flight or at aggregation)
REROUTED_EVENTS = frozenset({RecordName.REROUTE})  # a forward resent to another replica (the first one died)
EVAL_WAIT_S = 30.0  # an evaluated iteration's row waits this long at most for every stage's checkpoint

Validation = Callable[[int], float | None]
"""The validation loss of a checkpoint version (`runtime.validation.CheckpointValidation`)."""
DROPPED_EVENTS = frozenset({RecordName.DH_LOST})  # leader: a data holder died; `started` microbatches dropped


@dataclass(frozen=True, slots=True)
class SwarmOptions:
    """What `gwtf swarm` / `gwtf demo` ask for beyond the config."""

    out_dir: Path
    replicas: int = 2  # replicas of every relay stage
    churn: str = "none"  # none | low | high
    timeout_s: float = 600.0
    regions: tuple[str, ...] = ("local",)
    config_path: str | None = None
    overrides: tuple[str, ...] = ()
    faults: dict[str, str] = field(default_factory=dict)  # node name -> runtime.fault
    slowdowns: dict[str, float] = field(default_factory=dict)  # node name -> runtime.compute_slowdown
    resume: bool = False  # continue the run in out_dir from its newest complete checkpoint
    churn_spare: str = "none"  # none | leader | data-holders: nodes the churn never kills (CHURN_SPARE)
    # what the victim of each scheduled kill must be, in order ("data-holder", "relay" or "any");
    # the kills past its end: any (`gwtf demo` scripts its first kill to be a data holder's)
    churn_roles: tuple[str, ...] = ()


CHURN_SPARE = ("none", "leader", "data-holders")
CHURN_ROLES = ("any", "data-holder", "relay")


def initial_plans(cfg: Config, opts: SwarmOptions) -> list[NodePlan]:
    """Data holders dh0..dh{D-1} (stage 0, shard d) then relays r<k><a|b|...> per stage."""
    plans = []
    rng = random.Random(cfg.train.seed)
    for d in range(cfg.train.data_holders):
        name = f"dh{d}"
        plans.append(NodePlan(name=name, role="data-holder", stage="0", shard=d,
                              region=rng.choice(opts.regions), fault=opts.faults.get(name, ""),
                              slowdown=opts.slowdowns.get(name, 1.0)))
    for k in range(1, cfg.model.stages):
        for r in range(opts.replicas):
            name = f"r{k}{chr(ord('a') + r)}"
            plans.append(NodePlan(name=name, role="relay", stage=str(k), region=rng.choice(opts.regions),
                                  fault=opts.faults.get(name, ""), slowdown=opts.slowdowns.get(name, 1.0)))
    return plans


def churn_iterations(kind: str, iterations: int, rng: random.Random) -> list[int]:
    """Iterations after whose completion a node is killed (and a joiner started)."""
    if kind == "none" or iterations < 3:
        return []
    if kind == "low":
        return [rng.randint(1, max(1, iterations // 2))]
    if kind == "high":
        every = max(2, iterations // 5)
        # the last kill leaves its joiner one and a half periods to join and serve before the run
        # ends: a join takes seconds whatever the iteration time (two state fetches when the first
        # goes stale), and a period of short iterations on a loaded machine was not enough
        last = max(2, iterations - every - every // 2)
        return list(range(rng.randint(1, max(1, every // 2)), last, every))
    raise ValueError(f"unknown churn {kind!r} (none, low, high)")


@dataclass(slots=True)
class _Iteration:
    losses: dict[tuple[str, int], float] = field(default_factory=dict)
    tokens: dict[tuple[str, int], int] = field(default_factory=dict)
    stepped: set[str] = field(default_factory=set)
    redone: int = 0
    rerouted: int = 0
    dropped: int = 0
    unix_s: float = 0.0  # wall clock of the last data holder's step record
    lr: float | None = None
    grad_norms: dict[int, float] = field(default_factory=dict)  # stage -> pre-clip norm (replicas agree)
    waiting_since: float | None = None  # monotonic: when its row waited for checkpoints first


class SwarmMetrics:
    """Reads every node's records.jsonl incrementally and emits one row per completed iteration."""

    def __init__(self, out_dir: Path, microbatches: int = 0, first: int = 0,
                 prior: list[dict[str, Any]] | None = None, validation: Validation | None = None,
                 eval_every: int = 0, iterations: int = 0, stages: int = 0) -> None:
        """`first`: the first iteration these nodes train (a resumed run's checkpoint version);
        `prior`: the rows of earlier iterations kept from a previous attempt (metrics continue);
        `validation(version)`: the validation loss of a checkpoint version (None: no val_loss),
        asked every `eval_every` iterations and at iteration `iterations` - 1, once every one of
        the `stages` has logged its step (its checkpoint is written by then)."""
        self.out_dir = out_dir
        self.validation = validation
        self.eval_every = eval_every
        self.iterations = iterations
        self.stages = stages
        self.microbatches = microbatches
        self._tails: dict[str, JsonlTail] = {}
        self._its: dict[int, _Iteration] = {}
        self.rows: list[dict[str, Any]] = list(prior or [])
        self.first = first
        self.next_iteration = first  # the next iteration to complete
        self.holder_from: dict[str, int] = {}  # a node -> the first iteration it stepped as a data holder (stage 0)
        self.leader_terms: dict[int, str] = {}  # term -> the node that logged leading it (`leader_term`)
        self._time0 = float(self.rows[-1]["time_s"]) if self.rows else 0.0
        self.hashes: dict[tuple[int, int], dict[str, str]] = {}  # (iteration, stage) -> node -> hash
        self.records: dict[str, list[dict[str, Any]]] = {}
        self.unix_start_s = 0.0  # wall clock of the leader's (last) start of iteration 0
        self._file = (out_dir / "metrics.jsonl").open("a", encoding="utf-8")

    def poll(self, procs: list[NodeProcess]) -> None:
        for p in procs:
            tail = self._tails.setdefault(p.name, JsonlTail(p.dir / RECORDS_FILE))
            for row in tail.read_new():
                self.records.setdefault(p.name, []).append(row)
                if row.get("event") == RecordName.LEADER_TERM and isinstance(row.get("term"), int):
                    self.leader_terms[row["term"]] = p.name  # only the node that leads a term logs it
                self._absorb(p, row)

    def _absorb(self, p: NodeProcess, row: dict[str, Any]) -> None:
        event, it = row.get("event"), row.get("iteration")
        mb = row.get("mb")
        if not isinstance(it, int) and isinstance(mb, list) and len(mb) == 3 and isinstance(mb[1], int):
            it = mb[1]
        if not isinstance(it, int):
            return
        slot = self._its.setdefault(it, _Iteration())
        if event == RecordName.ITER_START and it == self.first == self.next_iteration:  # the leader starts training
            self.unix_start_s = max(self.unix_start_s, float(row.get("unix_s", 0.0)))
        # a data holder is a node at stage 0: planned so, or a joiner the leader gave a vacant shard
        if event == RecordName.LOSS:
            slot.losses[(p.name, int(row["index"]))] = float(row["loss"])
            slot.tokens[(p.name, int(row["index"]))] = int(row.get("tokens", 0))
        elif event == RecordName.STEPPED:
            if int(row["stage"]) == 0:
                self.holder_from.setdefault(p.name, it)
                slot.stepped.add(p.name)
                slot.unix_s = max(slot.unix_s, float(row.get("unix_s", 0.0)))
            self.hashes.setdefault((it, int(row["stage"])), {})[p.name] = str(row["hash"])
            if isinstance(row.get("lr"), (int, float)):
                slot.lr = float(row["lr"])
            if isinstance(row.get("grad_norm"), (int, float)):
                slot.grad_norms[int(row["stage"])] = float(row["grad_norm"])
        elif event in REDONE_EVENTS:
            slot.redone += 1
        elif event in REROUTED_EVENTS:
            slot.rerouted += 1
        elif event in DROPPED_EVENTS:
            slot.dropped += dropped_by(row, self.microbatches)

    def complete(self, procs: list[NodeProcess], started_s: float, crashes: int, joins: int) -> list[dict[str, Any]]:
        """Emit rows for iterations every live data holder has stepped (in order)."""
        new: list[dict[str, Any]] = []
        while True:
            it = self.next_iteration
            slot = self._its.get(it)
            live_dh = {p.name for p in procs if p.alive() and (
                self.holder_from.get(p.name, it + 1) <= it or p.plan.role == "data-holder")}
            if slot is None or not slot.stepped or not live_dh <= slot.stepped or self._waits(it, slot):
                return new
            now = self._time0 + ((slot.unix_s - self.unix_start_s) if slot.unix_s and self.unix_start_s
                                 else time.monotonic() - started_s)
            # the microbatches of data holders that stepped the iteration: a data holder that died
            # in it logged losses of microbatches the others then trained again (protocol.hold_batch)
            losses = {k: v for k, v in slot.losses.items() if k[0] in slot.stepped}
            tokens = sum(v for k, v in slot.tokens.items() if k[0] in slot.stepped)
            prev_t = self.rows[-1]["time_s"] if self.rows else 0.0
            row = {
                "iteration": it, "loss": sum(losses.values()) / max(1, len(losses)),
                "tokens": tokens, "time_s": round(now, 3),
                "tokens_per_s": round(tokens / max(1e-3, now - prev_t), 1),
                "microbatches": len(losses), "crashes": crashes, "joins": joins,
                "microbatches_redone": slot.redone, "microbatches_dropped": slot.dropped,
                "microbatches_rerouted": slot.rerouted, "lr": slot.lr,
                "grad_norms": [round(slot.grad_norms[k], 6) if k in slot.grad_norms else None
                               for k in range(self.stages or 1 + max(slot.grad_norms, default=0))],
            }
            if self._evaluated(it):
                row["val_loss"] = self.validation(it + 1) if self.validation is not None else None
            self.rows.append(row)
            self.next_iteration += 1
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            new.append(row)

    def _evaluated(self, it: int) -> bool:
        """Iteration `it` gets a val_loss (train --local's cadence: every eval_every, and the last)."""
        done = it + 1
        return self.validation is not None and (
            done == self.iterations or (self.eval_every > 0 and done % self.eval_every == 0))

    def _waits(self, it: int, slot: _Iteration) -> bool:
        """An evaluated iteration's row waits (bounded, EVAL_WAIT_S) until every stage stepped."""
        if not self._evaluated(it) or all((it, k) in self.hashes for k in range(self.stages)):
            return False
        if slot.waiting_since is None:
            slot.waiting_since = time.monotonic()
        return time.monotonic() - slot.waiting_since < EVAL_WAIT_S

    def leader(self) -> str | None:
        """The node that logged the newest term it leads (it may have died since), if any."""
        return self.leader_terms[max(self.leader_terms)] if self.leader_terms else None

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()


NODES_DIR = "nodes"
METRICS_FILE = "metrics.jsonl"


def previous_run(out_dir: Path) -> bool:
    """Does `out_dir` hold an earlier run (node folders, metrics or checkpoints)?"""
    return any((out_dir / name).exists() for name in (NODES_DIR, METRICS_FILE, CHECKPOINTS_DIR))


def prepare_out_dir(cfg: Config, opts: SwarmOptions, say: Callable[[str], None]) -> tuple[int, list[dict[str, Any]]]:
    """A fresh run clears an earlier run's node folders, metrics and checkpoints (stale records
    would be read back as this run's, stale checkpoints resumed from). A resumed run finds its
    version V (`checkpoints.resume_version`, warnings through `say`), moves the old node folders
    to `nodes-<k>/` (k = 1, 2, ...: one per earlier attempt) and keeps the metrics rows of
    iterations < V. Returns (V, kept rows); V = 0 for a fresh run."""
    out = opts.out_dir
    if not opts.resume:
        for name in (NODES_DIR, CHECKPOINTS_DIR, *(p.name for p in out.glob(f"{NODES_DIR}-*"))):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / METRICS_FILE).unlink(missing_ok=True)
        return 0, []
    first = resume_version(out / CHECKPOINTS_DIR, cfg.model.stages, cfg.train.iterations,
                           cfg.protocol.checkpoint_every, warn=say)
    if (out / NODES_DIR).exists():
        k = 1
        while (out / f"{NODES_DIR}-{k}").exists():
            k += 1
        (out / NODES_DIR).rename(out / f"{NODES_DIR}-{k}")
    return first, _keep_metrics(out / METRICS_FILE, first)


def _keep_metrics(path: Path, before: int) -> list[dict[str, Any]]:
    """Rewrite `path` with its rows of iterations < `before` (atomically); return them."""
    rows: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed run
            if isinstance(row, dict) and isinstance(row.get("iteration"), int) and row["iteration"] < before:
                rows.append(row)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return rows


class _ResumeGroup(ProcessGroup):
    """Starts every node with `--resume` (the bootstrap node loads the checkpoint, see `gwtf node`)."""

    def command(self, plan: NodePlan, join: str | None, listen: str = "127.0.0.1:0") -> list[str]:
        return [*super().command(plan, join, listen), "--resume"]


class Swarm:
    """One local swarm run; use as a context manager so every process dies with it."""

    def __init__(self, cfg: Config, opts: SwarmOptions, say: Callable[[str], None] = print,
                 validation: Validation | None = None) -> None:
        self.cfg = cfg
        self.opts = opts
        self.say = say
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        self.first, prior = prepare_out_dir(cfg, opts, say)
        members = cfg.train.data_holders + opts.replicas * (cfg.model.stages - 1)
        overrides = (*opts.overrides, f"runtime.start_members={members}")
        group = _ResumeGroup if opts.resume else ProcessGroup
        self.group = group(opts.out_dir, opts.config_path, overrides, secret_file=cfg.runtime.secret_file or None)
        self.metrics = SwarmMetrics(opts.out_dir, cfg.train.microbatches, self.first, prior, validation,
                                    cfg.train.eval_every, cfg.train.iterations, cfg.model.stages)
        self.rng = random.Random(cfg.train.seed + 7919)
        self.crashes = 0
        self.joiners: list[str] = []  # names of the joiners started, in order
        self.churn_killed: list[tuple[str, int]] = []  # the churn's victims, in order: (name, stage)
        self._holder_joiners: set[str] = set()  # joiners announced as data holders
        self._reported_exits: set[str] = set()
        self.started_s = time.monotonic()
        self._pending_kills = [k for k in churn_iterations(opts.churn, cfg.train.iterations, self.rng)
                               if k > self.first]
        self._kill_at_s: float | None = None
        self._kills_due = 0  # scheduled kills whose moment came (the index into opts.churn_roles)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every node (idempotent), then read their last records. Its kills are no crashes:
        a node still running now is never counted by a later `step`."""
        self._reported_exits.update(p.name for p in self.group.procs if p.popen.poll() is None)
        self.group.close()
        if not self.metrics.closed:
            self.metrics.poll(self.group.procs)
            self.metrics.close()

    def start(self) -> None:
        """Start the bootstrap data holder, then every other node through it; return once all are
        members (the leader holds iteration 0 until then: runtime.start_members)."""
        plans = initial_plans(self.cfg, self.opts)
        ready_s = self.cfg.runtime.ready_timeout_s
        first = self.group.spawn(plans[0])
        self.group.wait_ready([first], ready_s)
        rest = [self.group.spawn(p, join=first.addr) for p in plans[1:]]
        self.group.wait_ready(rest, ready_s)
        self.wait_state([first, *rest], "active", ready_s)
        self.started_s = time.monotonic()
        self.say(f"swarm of {len(plans)} nodes ready (bootstrap {first.name} at {first.addr})")

    def wait_state(self, procs: list[NodeProcess], state: str, timeout_s: float) -> None:
        """Poll the nodes' status files until each reports `state` (bounded)."""
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        while pending:
            pending = [p for p in pending if (read_status(p.dir / STATUS_FILE) or {}).get("state") != state]
            for p in pending:
                if not p.alive():
                    raise NodeStartError(f"node {p.name} exited before becoming {state}:\n{p.log_tail()}")
            if pending and time.monotonic() > deadline:
                raise NodeStartError(f"{pending[0].name} not {state} within {timeout_s:.0f}s:\n{pending[0].log_tail()}")
            if pending:
                time.sleep(0.05)  # polling period of a bounded wait

    def join_node(self, stage: str = "auto") -> NodeProcess:
        """Start a joiner through a random live node (`--stage auto`: the leader makes it a data
        holder on a vacant shard, else sends it to a relay stage)."""
        live = [p for p in self.group.live() if p.ready is not None]
        contact = self.rng.choice(live)
        name = f"j{len(self.joiners) + 1}"
        self.joiners.append(name)
        plan = NodePlan(name=name, role="relay", stage=stage, region=self.rng.choice(self.opts.regions))
        proc = self.group.spawn(plan, join=contact.addr)
        return proc

    @property
    def joins(self) -> int:
        """Joiners that served (activated, then contributed a microbatch)."""
        return sum(1 for name in self.joiners if served(self.metrics.records.get(name, [])))

    @property
    def holders_replaced(self) -> list[str]:
        """Joiners that stepped as data holders (a vacant shard's new holder), in start order."""
        return [name for name in self.joiners if name in self.metrics.holder_from]

    def churn_victims(self, role: str = "any") -> list[NodeProcess]:
        """The nodes a churn kill may pick now (by name; each as likely as another): every live,
        active node that served (contributed microbatches to its stage: a relay forwarded them, a
        data holder trained them) and whose stage keeps at least one other live, active node:
        another replica of a relay stage, another data holder for stage 0 (a joiner that is not
        active yet does not count: killing the last active replica would lose the stage, the last
        data holder would pause training; one that has not served yet is not a victim: a churn
        that kills joiners before they serve shows nothing). A data holder is a node at stage 0:
        an initial one, or a joiner the leader gave a vacant shard; the leader (the node that
        logged the newest `leader_term`) is one of them. `role`: "data-holder" or "relay" keeps
        only those; `opts.churn_spare` drops the leader ("leader": every data holder while no live
        node is known to lead, an election under way) or every data holder ("data-holders")."""
        if role not in CHURN_ROLES:
            raise ValueError(f"unknown churn role {role!r} ({', '.join(CHURN_ROLES)})")
        spare = self.opts.churn_spare
        if spare not in CHURN_SPARE:
            raise ValueError(f"unknown churn spare {spare!r} ({', '.join(CHURN_SPARE)})")
        live = [p for p in self.group.live() if p.ready is not None]
        status = {p.name: read_status(p.dir / STATUS_FILE) or {} for p in live}
        active = [p for p in live if status[p.name].get("state") == "active"]
        stage_of = {p.name: self._stage(p, status[p.name]) for p in active}
        leader = self.metrics.leader()
        leader_live = any(p.name == leader for p in live)
        victims = []
        for p in active:
            stage = stage_of[p.name]
            if stage is None or int(status[p.name].get("microbatches") or 0) <= 0:
                continue
            if sum(1 for q in active if stage_of[q.name] == stage) < 2:
                continue
            holder = stage == 0
            if (role == "data-holder" and not holder) or (role == "relay" and holder):
                continue
            if holder and (spare == "data-holders" or (spare == "leader" and (p.name == leader or not leader_live))):
                continue
            victims.append(p)
        return sorted(victims, key=lambda p: p.name)

    def kill_random_node(self, role: str = "any") -> NodeProcess | None:
        """kill -9 one of `churn_victims(role)`, chosen by the swarm's seeded rng (None: none)."""
        victims = self.churn_victims(role)
        if not victims:
            return None
        victim = self.rng.choice(victims)
        stage = self.stage_of(victim)
        assert stage is not None  # a victim is active at a known stage
        self.group.kill(victim)
        self.crashes += 1
        self.churn_killed.append((victim.name, stage))
        return victim

    @property
    def holders_killed(self) -> list[str]:
        """The churn's victims that were data holders (stage 0), in order."""
        return [name for name, stage in self.churn_killed if stage == 0]

    def stage_of(self, p: NodeProcess) -> int | None:
        return self._stage(p, read_status(p.dir / STATUS_FILE) or {})

    @staticmethod
    def _stage(p: NodeProcess, status: dict[str, Any]) -> int | None:
        """The node's stage: its status file's, else its ready line's (None: not known yet)."""
        stage = status.get("stage", p.ready.get("stage") if p.ready else None)
        return stage if isinstance(stage, int) and stage >= 0 else None

    def step(self) -> list[dict[str, Any]]:
        """One poll: read records, notice (and count) nodes that died, emit finished iterations,
        apply churn. Returns new metric rows."""
        procs = self.group.procs
        self.metrics.poll(procs)
        for p in procs:
            if p.state == "starting":
                try:
                    self.group.check_ready(p)
                except RuntimeError as exc:
                    self.say(f"joiner {p.name} failed: {exc}")
                    self._exited(p, announced=True)
            elif p.popen.poll() is not None:
                self._exited(p)
        new = self.metrics.complete(procs, self.started_s, self.crashes, self.joins)
        for name in self.holders_replaced:
            if name not in self._holder_joiners:
                self._holder_joiners.add(name)
                self.say(f"churn: joiner {name} replaced a data holder (from iteration "
                         f"{self.metrics.holder_from[name]})")
        self._churn(new)
        return new

    def _exited(self, p: NodeProcess, announced: bool = False) -> None:
        """A node process found dead (once per node): say how it ended; count it in `crashes`
        unless the swarm itself ended it (churn's kill -9 is counted where it happens)."""
        if p.name in self._reported_exits or p.state in SWARM_ENDED:
            return
        self._reported_exits.add(p.name)
        mark_dead(p)
        code = p.popen.returncode
        if crashed(code):
            self.crashes += 1
        if announced or (code == 0 and (read_status(p.dir / STATUS_FILE) or {}).get("stop_reason") == "finished"):
            return  # (the run's end: every node exits so; the final line says it once)
        self.metrics.poll([p])  # its last records: a fault's record is flushed just before its SIGKILL
        fault = fault_fired(self.metrics.records.get(p.name, []))
        if fault is not None and code == -signal.SIGKILL:
            where = ", ".join(f"{what} {fault[k]}" for k, what in (("point", "at"), ("iteration", "iteration"),
                                                                    ("index", "microbatch"))
                              if fault.get(k) not in (None, ""))
            self.say(f"node {p.name} crashed: its scripted fault fired ({where or 'at its time'})")
        elif code < 0:
            self.say(f"node {p.name} was killed by {signal.Signals(-code).name}")
        else:
            reason = (read_status(p.dir / STATUS_FILE) or {}).get("stop_reason") or "no reason recorded"
            self.say(f"node {p.name} exited with code {code}: {reason}")

    def _churn(self, new_rows: list[dict[str, Any]]) -> None:
        done = self.metrics.next_iteration
        if self._pending_kills and done >= self._pending_kills[0] and self._kill_at_s is None:
            rows = self.metrics.rows
            last = rows[-1]["time_s"] - (rows[-2]["time_s"] if len(rows) > 1 else 0.0)
            self._kill_at_s = time.monotonic() + self.rng.uniform(0.1, 0.9) * max(0.05, last)
        if self._kill_at_s is not None and time.monotonic() >= self._kill_at_s:
            self._kill_at_s = None
            roles = self.opts.churn_roles
            role = roles[self._kills_due] if self._kills_due < len(roles) else "any"
            leader = self.metrics.leader()
            victim = self.kill_random_node(role)
            if victim is None and role != "any":
                return  # a scripted victim's kill (a data holder, a relay) is tried again a moment later
            self._pending_kills.pop(0)
            self._kills_due += 1
            if victim is None:
                self.say(f"churn: no node may be killed after iteration {done} (none that served and whose "
                         "stage keeps another active node); this kill is skipped")
                return
            stage = self.churn_killed[-1][1]
            if stage == 0:
                what = "data holder, the leader" if victim.name == leader else "data holder"
            else:
                what = f"relay, stage {stage}"
            self.say(f"churn: kill -9 {victim.name} ({what})")
            joiner = self.join_node()
            self.say(f"churn: joiner {joiner.name} started")

    def run_until(self, iterations: int, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Poll (records, churn) until `iterations` are complete and some replica of every stage
        has logged its step of the last one; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not self.complete(iterations):
            self.step()
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)  # polling period of a bounded wait, not synchronisation
        return True

    def log_tails(self, n_bytes: int = 1500) -> str:
        return "\n".join(f"--- {p.name} ({p.state})\n{p.log_tail(n_bytes)}" for p in self.group.procs)

    def audit(self, iterations: int | None = None) -> tuple[list[str], dict[str, Any]]:
        """The exactly-once ledger of the completed iterations, from the node logs: the very
        audit `gwtf audit` runs on the out folder (`audit.audit_run`)."""
        self.metrics.poll(self.group.procs)
        n = self.metrics.next_iteration if iterations is None else iterations
        return audit_run(self.metrics.records, self.cfg.model.stages, self.cfg.train.microbatches, n,
                         first=self.first, run_iterations=self.cfg.train.iterations,
                         data_holders=self.cfg.train.data_holders)

    def complete(self, iterations: int) -> bool:
        """`iterations` are done and some replica of every stage has logged the last step."""
        return self.metrics.next_iteration >= iterations and all(
            (iterations - 1, k) in self.metrics.hashes for k in range(self.cfg.model.stages))

    def finished(self) -> bool:
        return self.complete(self.cfg.train.iterations)

    def table_rows(self) -> list[dict[str, Any]]:
        rows = []
        for p in self.group.procs:
            status = read_status(p.dir / STATUS_FILE) or {}
            row = {"name": p.name, "role": p.plan.role, "region": p.plan.region, **status}
            if not p.alive():
                row["state"] = {"killed": "crashed"}.get(p.state, p.state if p.state != "ready" else "exited")
                if row["state"] == "exited" and status.get("stop_reason"):
                    row["state"] = str(status["stop_reason"])
            elif p.state == "starting":
                row["state"] = "starting"
            elif self._silent(p):
                row["state"] = "silent"  # alive but not rewriting its status: frozen or its loop stalled
            rows.append(row)
        return rows

    def _silent(self, p: NodeProcess) -> bool:
        """No status rewrite for longer than the protocol's eviction bound (plus one period)."""
        try:
            age_s = time.time() - (p.dir / STATUS_FILE).stat().st_mtime
        except OSError:
            return False
        return age_s > self.cfg.protocol.evict_after_s + self.cfg.runtime.status_period_s

    def stalled(self) -> list[int]:
        """Stages with no live active node right now (see `status.stalled_stages`)."""
        return stalled_stages(self.table_rows(), self.cfg.model.stages)


SWARM_ENDED = frozenset({"killed", "stopped"})  # `ProcessGroup.kill` / `.stop`: the swarm ended the node


def crashed(returncode: int) -> bool:
    """Did a node process that ended by itself (not by the swarm: `SWARM_ENDED`) crash? Any
    signal (a scripted fault's SIGKILL of itself, a kill -9 from outside, the OOM killer) or a
    non-zero exit code (an error, or a node that gave up: evicted, partitioned, a failed
    compute) is a crash; exit 0 (training finished, or a graceful leave) is not."""
    return returncode != 0


def fault_fired(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The node's `fault` record of a crash (its scripted fault fired: the node then SIGKILLs
    itself, right after flushing that record), or None."""
    for row in reversed(records):
        if row.get("event") == RecordName.FAULT and row.get("action") == "crash":
            return row
    return None


def served(records: list[dict[str, Any]]) -> bool:
    """A node's records show it activated (a joiner's activation) and then contributed work."""
    active = False
    for row in records:
        if row.get("event") == RecordName.ACTIVATED:
            active = True
        elif active and row.get("event") == RecordName.CONTRIBUTE:
            return True
    return False
