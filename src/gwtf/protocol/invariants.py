"""Invariants checked on every run, simulated or real, from the Records the cores emit (the simulator
feeds them as they happen; `gwtf.runtime.audit` replays real nodes' records through the same checker).

Owns: `InvariantChecker`. Violations are strings (the first 50 kept, all counted); tests assert
there are none.

1. Exactly once: every applied aggregation decision (a `decision` record whose round some
   replica stepped with) covers each expected microbatch exactly once at its stage, names no
   microbatch twice, and names only microbatches that were started. Every data holder that
   started microbatches in the iteration and was alive at the decision is in the expected set,
   with all the microbatches it started (a crashed DH's microbatches are dropped and counted).
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

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from typing import Any

MAX_KEPT = 50


class InvariantChecker:
    def __init__(self, stages: int, progress_bound_s: float, iterations: int = 0,
                 leaderless_stops: bool = False) -> None:
        self.stages = stages
        self.leaderless_stops = leaderless_stops  # losing every data holder may end the run (see 3.)
        self.iterations = iterations  # the run's length (0: unknown): no step may go past it
        self.progress_bound_s = progress_bound_s
        self.violations: list[str] = []
        self.count = 0
        self.epoch = 0  # bumps on every rollback: an iteration may then run again
        self.dead_at: dict[str, float] = {}
        self.started: dict[tuple[int, int], dict[str, set[int]]] = {}
        # (epoch, iteration) -> (data holder, n) -> the batch's (shard, index) its microbatch n trains
        self.data: dict[tuple[int, int], dict[tuple[str, int], tuple[int, int]]] = {}
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
        if event == "mb_start":
            mb = f["mb"]
            self.started.setdefault((self.epoch, mb[1]), {}).setdefault(mb[0], set()).add(mb[2])
            data = f.get("data")
            if data is not None and data[0] >= 0:
                self.data.setdefault((self.epoch, mb[1]), {})[(mb[0], mb[2])] = (int(data[0]), int(data[1]))
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
        data = self.data.get((self.epoch, it), {})
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
