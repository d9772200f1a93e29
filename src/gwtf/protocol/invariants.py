"""Invariants checked on every run, simulated or real, from the Records the cores emit (the simulator
feeds them as they happen; `gwtf.runtime.audit` replays real nodes' records through the same checker).

Owns: `InvariantChecker` and its `BatchAccount`. Violations are strings (the first 50 kept, all
counted); tests assert there are none.

1. Exactly once: every applied aggregation decision (a `decision` record whose round some
   replica stepped with) covers each expected microbatch exactly once at its stage, names no
   microbatch twice, and names only microbatches that were started. Every data holder that
   started microbatches in the iteration and was alive at the decision is in the expected set,
   with all the microbatches it started (a crashed DH's microbatches leave the decision: served
   again under other ids, or dropped; both counted in 5.).
   The batch's data is trained once: no two microbatches of a decision train the same (shard,
   index) of the iteration (`mb_start`'s `data`: a vacant shard's microbatches are served by
   other data holders, `protocol.hold_batch`).
2. Same weights: all replicas of a stage step iteration t with the same round and contributors
   and reach version t+1 (a replica that stepped otherwise and then died does not count: its
   state died with it).
3. Progress / no microbatch in flight forever: an iteration completes at least every
   `progress_bound_s` unless a whole stage is lost; at the end, all live active replicas hold
   the same version. A run that ends before its iterations is excused only for a reason the
   checker names (`stop_reason`): "stage K lost with no node left for it" (no live node that
   could still take the stage over, e.g. a joiner; stage 0 is no exception: joiners become data
   holders), or, only where a swarm without data holders cannot elect a leader (bounded views,
   `protocol.view_size`: `leaderless_stops`), "no data holder left"; anything else (a joiner
   waiting on a dead state source, a lost quorum, a hang) is a deadlock.
4. Fenced leadership: no two nodes lead the same term (`leader_term` records), and no
   (stage, version) is stepped with two different contents (round and contributors) by
   replicas that are still alive: `divergent_step` in 2.
5. The global batch (`BatchAccount`, owned by the checker as `batch`; DESIGN.md 3, issue 42):
   for every committed iteration (the leader's `iteration_done`) the microbatches trained (its
   `expected`) against the full batch, D x M (`full_batch`, from the config; 0: unknown), the
   microbatches of data holders lost in it (`dh_lost`) that were served again in it (`Deal`:
   `reserved`) or not trained (`dropped`), and the cause of every shortfall (`short_detail`).
   The (shard, index) pairs of its applied stage-0 decision (`mb_start`'s `data`) are as many
   as it counted (`batch_count`); with 1. (`data_twice`, `missing`) every (shard, index) of a
   committed iteration contributed exactly once at every stage. A short iteration is reported,
   not a violation: the paper's behaviour (`protocol.hold_batch` off) drops a crashed data
   holder's share. The simulator's summary.json (`full_batch`, `short_iterations`,
   `short_detail`) and the runtime audit (`gwtf audit`, `gwtf swarm`) read it from here.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_KEPT = 50
SHORT_KEPT = 20  # the short iterations `BatchAccount.fields` details (the first ones)
SHORT_LOST = "a data holder lost in it"  # a short iteration's cause (summary.json contract strings)
SHORT_UNHELD = "shards with no data holder (batch not held)"


@dataclass(frozen=True, slots=True)
class Committed:
    """The batch of one committed iteration (`BatchAccount`)."""

    iteration: int
    microbatches: int  # trained: the leader's count (`iteration_done`'s `expected`)
    lost: int  # microbatches of data holders lost in it (`dh_lost`), trained again or not
    dropped: int  # ... of them not trained: the iteration is short by them
    reserved: int  # ... of them trained all the same, served again by live data holders (`Deal`)
    cause: str  # why it trained fewer than the full batch; "" when it did not


class BatchAccount:
    """The global batch of every committed iteration (see the module docstring, 5.).

    Fed the same Records as the checker (by it, or by `sim.metrics.Metrics` on its own).
    `full_batch`: D x M (0: unknown, no iteration is short then and every lost microbatch counts
    as dropped); `microbatches`: M, what a data holder lost before it reported its microbatches
    had (its `dh_lost` says `started` -1); `violate`: where `batch_count` goes (None: nowhere).
    """

    def __init__(self, full_batch: int = 0, microbatches: int = 0,
                 violate: Callable[[str], None] | None = None) -> None:
        self.full_batch = full_batch
        self.microbatches = microbatches
        self.violate = violate
        self.epoch = 0  # bumps on every rollback: an iteration may then run again
        # (epoch, iteration) -> (data holder, n) -> the batch's (shard, index) its microbatch n trains
        self.data: dict[tuple[int, int], dict[tuple[str, int], tuple[int, int]]] = {}
        self._lost: dict[tuple[int, int], dict[str, int]] = {}  # -> data holder -> its microbatches
        self._stage0: dict[tuple[int, int], dict[int, Any]] = {}  # -> round -> stage 0's contributions
        # (epoch, iteration) -> its commit; a commit again in one epoch (a new leader ran the
        # iteration again: the first was never stepped) replaces the first
        self.committed: dict[tuple[int, int], Committed] = {}

    def on_record(self, event: str, f: dict[str, Any]) -> None:
        if event == "mb_start":
            data = f.get("data")
            if data is not None and data[0] >= 0:
                mb = f["mb"]
                self.data.setdefault((self.epoch, mb[1]), {})[(mb[0], mb[2])] = (int(data[0]), int(data[1]))
        elif event == "decision" and f["stage"] == 0:
            self._stage0.setdefault((self.epoch, f["iteration"]), {})[f["round"]] = f["contributions"]
        elif event == "dh_lost":
            self._on_dh_lost(f)
        elif event == "iteration_done":
            self._commit(int(f["iteration"]), int(f["round"]), int(f["expected"]))
        elif event == "rollback":
            self.epoch += 1
            it = int(f.get("version", 0)) - 1  # (see InvariantChecker: the step a restart completes)
            if (self.epoch - 1, it) in self.data:
                self.data[(self.epoch, it)] = self.data[(self.epoch - 1, it)]

    def _on_dh_lost(self, f: dict[str, Any]) -> None:
        started = int(f.get("started", -1))
        if started == 0:
            return  # lost during the commit with its gradient in the reduction: its microbatches are trained
        key, dh = (self.epoch, int(f["iteration"])), str(f["node"])
        if started < 0:  # lost before it reported: its shard's M, or more if it had started more (dealt ones)
            started = max(self.microbatches, sum(1 for d, _ in self.data.get(key, {}) if d == dh))
        per = self._lost.setdefault(key, {})
        per[dh] = max(per.get(dh, 0), started)  # (a new leader may record the same loss again)

    def _commit(self, it: int, rnd: int, trained: int) -> None:
        key = (self.epoch, it)
        lost_by = self._lost.get(key, {})
        lost = sum(lost_by.values())
        full = self.full_batch
        short = full - trained if full and trained < full else 0
        dropped = min(lost, short) if full else lost
        cause = "" if not short else SHORT_LOST if lost_by else SHORT_UNHELD
        self.committed[key] = Committed(it, trained, lost, dropped, lost - dropped, cause)
        self._check_pairs(key, self._stage0.pop(key, {}).get(rnd), trained)

    def _check_pairs(self, key: tuple[int, int], contributions: Any, trained: int) -> None:
        """The applied stage-0 decision trains as many distinct (shard, index) as the leader
        counted (unchecked where a microbatch's data is unknown)."""
        if contributions is None or self.violate is None:
            return
        data = self.data.get(key, {})
        pairs = [data.get((origin, n)) for mbs in contributions.values() for origin, n in mbs]
        if any(p is None for p in pairs):
            return
        if len(set(pairs)) != trained:
            self.violate(f"batch_count: iteration {key[1]} trained {len(set(pairs))} distinct (shard, index) at "
                         f"stage 0 but counted {trained}")

    def fields(self, first: int = 0, end: int | None = None) -> dict[str, Any]:
        """The account of the commits of iterations first..end-1 (all by default), every commit
        (a rolled-back iteration's too): `full_batch`, `short_iterations`, `short_detail` (the
        first `SHORT_KEPT`: iteration, microbatches trained, cause), `dropped`, `reserved`."""
        kept = [c for c in self.committed.values() if first <= c.iteration and (end is None or c.iteration < end)]
        short = [c for c in kept if c.cause]
        return {
            "full_batch": self.full_batch, "short_iterations": len(short),
            "short_detail": [{"iteration": c.iteration, "microbatches": c.microbatches, "cause": c.cause}
                             for c in short[:SHORT_KEPT]],
            "dropped": sum(c.dropped for c in kept), "reserved": sum(c.reserved for c in kept),
        }


class InvariantChecker:
    def __init__(self, stages: int, progress_bound_s: float, iterations: int = 0,
                 leaderless_stops: bool = False, full_batch: int = 0, microbatches: int = 0) -> None:
        """`full_batch` (D x M) and `microbatches` (M): the global batch's (see `BatchAccount`)."""
        self.stages = stages
        self.leaderless_stops = leaderless_stops  # losing every data holder may end the run (see 3.)
        self.iterations = iterations  # the run's length (0: unknown): no step may go past it
        self.progress_bound_s = progress_bound_s
        self.violations: list[str] = []
        self.count = 0
        self.epoch = 0  # bumps on every rollback: an iteration may then run again
        self.dead_at: dict[str, float] = {}
        self.started: dict[tuple[int, int], dict[str, set[int]]] = {}
        # 5. (its `data`: mb_start's); its violations through `violate`, as it is when they come
        self.batch = BatchAccount(full_batch, microbatches, lambda text: self.violate(text))
        self.decisions: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.applied: dict[tuple[int, int, int], tuple[int, tuple[str, ...], set[str]]] = {}
        self.last_progress_s = 0.0
        self.stage_lost = False
        self.leaders: dict[int, str] = {}  # term -> the node that led it
        self.stop_reason = ""  # why an unfinished run stopped, when it is an allowed reason

    def violate(self, text: str) -> None:
        self.count += 1
        if len(self.violations) < MAX_KEPT:
            self.violations.append(text)

    def on_dead(self, node: str, now: float) -> None:
        self.dead_at.setdefault(node, now)

    def on_record(self, now: float, node: str, event: str, f: dict[str, Any]) -> None:
        self.batch.on_record(event, f)
        if event == "mb_start":
            mb = f["mb"]
            self.started.setdefault((self.epoch, mb[1]), {}).setdefault(mb[0], set()).add(mb[2])
        elif event == "decision":
            key = (self.epoch, f["iteration"], f["round"], f["stage"])
            self.decisions[key] = {"time": now, "contributions": f["contributions"], "expected": f["expected"]}
        elif event == "step":
            self._on_step(now, node, f)
        elif event == "leader_term":
            term = f["term"]
            first = self.leaders.setdefault(term, node)
            if first != node:
                self.violate(f"two_leaders: {first} and {node} both lead term {term}")
        elif event == "iteration_done":
            self._progress(now)
            self.stage_lost = False
        elif event == "evict":
            self.on_dead(f["node"], now)  # declared dead by the leader (a zombie counts as dead)
        elif event == "stage_lost":
            self.stage_lost = True
        elif event == "rollback":
            self.epoch += 1
            self.last_progress_s = now
            self.stage_lost = False
            self._carry(int(f.get("version", 0)) - 1)

    def _carry(self, it: int) -> None:
        """A rollback to version v may still see steps of iteration v-1 (train.update_delay 1: a
        replica restarted at v applies the step it held pending): that iteration's decisions,
        steps and starts count in the new epoch too."""
        old = self.epoch - 1
        for (e, i, rnd, stage), d in list(self.decisions.items()):
            if e == old and i == it:
                self.decisions[(self.epoch, i, rnd, stage)] = d
        for (e, i, stage), a in list(self.applied.items()):
            if e == old and i == it:
                self.applied[(self.epoch, i, stage)] = a
        if (old, it) in self.started:
            self.started[(self.epoch, it)] = self.started[(old, it)]

    def _progress(self, now: float) -> None:
        if now - self.last_progress_s > self.progress_bound_s and not self.stage_lost:
            self.violate(f"no_progress: {now - self.last_progress_s:.1f}s without an iteration at t={now:.1f}")
        self.last_progress_s = now

    def _on_step(self, now: float, node: str, f: dict[str, Any]) -> None:
        it, rnd, stage = f["iteration"], f["round"], f["stage"]
        if self.iterations and it >= self.iterations:
            self.violate(f"beyond_end: {node} stepped iteration {it} of a {self.iterations}-iteration run")
        if f["version"] != it + 1:
            self.violate(f"version: {node} stepped iteration {it} to version {f['version']}")
        akey = (self.epoch, it, stage)
        contributors = tuple(f["contributors"])
        prev = self.applied.get(akey)
        if prev is not None:
            if (prev[0], prev[1]) == (rnd, contributors):
                prev[2].add(node)
                return
            if any(n not in self.dead_at for n in prev[2]):
                self.violate(f"divergent_step: {node} stage {stage} iteration {it} round {rnd} vs {prev[0]}")
                return
            # every replica that stepped the other way is dead: its state died with it
        self.applied[akey] = (rnd, contributors, {node})
        d = self.decisions.get((self.epoch, it, rnd, stage))
        if d is None:
            self.violate(f"step_without_decision: {node} iteration {it} round {rnd} stage {stage}")
            return
        self._check_decision(it, stage, d)

    def _check_decision(self, it: int, stage: int, d: dict[str, Any]) -> None:
        seen: dict[tuple[str, int], str] = {}
        for rep, mbs in sorted(d["contributions"].items()):
            for mb in mbs:
                mb = tuple(mb)
                if mb in seen:
                    self.violate(f"twice: {mb} at stage {stage} iteration {it} by {seen[mb]} and {rep}")
                seen[mb] = rep
        data = self.batch.data.get((self.epoch, it), {})
        trained: dict[tuple[int, int], tuple[str, int]] = {}
        for mb in seen:  # the batch's (shard, index): at most once per stage, whoever served it
            what = data.get(mb)
            if what is not None:
                if what in trained:
                    self.violate(f"data_twice: shard {what[0]} index {what[1]} at stage {stage} iteration {it} "
                                 f"as {trained[what]} and {mb}")
                trained[what] = mb
        started = self.started.get((self.epoch, it), {})
        for mb in seen:
            if mb[1] not in started.get(mb[0], set()):
                self.violate(f"phantom: {mb} at stage {stage} iteration {it} was never started")
        expected = {dh: set(idx) for dh, idx in d["expected"]}
        for dh, idx in sorted(expected.items()):
            for i in sorted(idx):
                if (dh, i) not in seen:
                    self.violate(f"missing: {(dh, i)} at stage {stage} iteration {it}")
        for dh, idx in sorted(started.items()):
            died = self.dead_at.get(dh)
            if died is not None and died <= d["time"]:
                continue
            if expected.get(dh) != idx:
                self.violate(f"dropped_live_dh: {dh} iteration {it} stage {stage} expected "
                             f"{sorted(expected.get(dh, ()))} started {sorted(idx)}")

    def finish(self, now: float, finished: bool, stage_lost: bool, versions: dict[str, int],
               live: dict[str, tuple[int, bool]] | None = None) -> None:
        """End of run. `live`: every node still running -> (stage, is an active member); a
        joiner that has not chosen its stage yet has stage -1. Without it (old callers) a lost
        stage alone excuses an unfinished run."""
        if finished and len(set(versions.values())) > 1:
            self.violate(f"final_versions_differ: {sorted(set(versions.values()))}")
        if finished:
            return
        self.stop_reason = stop_reason(self.stages, live, self.leaderless_stops) if live is not None else \
            ("a stage lost" if stage_lost else "")
        if not self.stop_reason:
            self.violate(f"deadlock: run ended at t={now:.1f} before its iterations, "
                         f"{'with a lost stage that a live node could take' if stage_lost else 'every stage alive'}")
            self._progress(now)


def stop_reason(stages: int, live: dict[str, tuple[int, bool]], leaderless_stops: bool = False) -> str:
    """The allowed reason an unfinished run stopped, or "" when there is none: a stage with no
    active replica and no live node that could still take it (a node not yet active: a joiner,
    which would take the lost stage, stage 0 included); with `leaderless_stops` (bounded views:
    relays cannot lead) also no data holder left."""
    if leaderless_stops and not any(stage == 0 and active for stage, active in live.values()):
        return "no data holder left"
    covered = {stage for stage, active in live.values() if active}
    lost = [k for k in range(stages) if k not in covered]
    if not lost:
        return ""
    if any(not active for _, active in live.values()):
        return ""  # a live joiner could have taken the stage over: it is stuck
    return f"stage {lost[0]} lost with no node left for it"
