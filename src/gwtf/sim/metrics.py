"""Run metrics: training time, throughput, GPU waste, recovery time, per-iteration timeline.

Owns: `Metrics`, fed by the simulator with Records, compute jobs and churn events, and its
`summary()` (plain dict, rounded, no wall-clock values: same seed -> same bytes) and
`timeline_rows()` (timeline.csv). Definitions (docs/simulator.md):
- busy_s: every compute second any node spent;
- discarded_s: compute seconds spent on a microbatch at a node whose contribution for it never
  entered an applied step (crashed replica, reset duplicate, rerouted original, rolled-back
  iteration); iterations unfinished when the run stops are left out of both;
- available_s: seconds each active node was alive during the run; idle_s = available - busy;
- discarded_fraction = discarded_s / busy_s of finished iterations (the share of the compute
  done that recovery threw away: the paper's "waste"; a summary.json contract, meaning kept),
  split by where the work ran: discarded_crashed_s / _fraction, work of nodes that had crashed
  by the time it was thrown away (gone with the GPU: no recovery can keep a contribution that
  never left it), and
  discarded_live_s / _fraction, work of nodes alive (or gone gracefully) when it was thrown away
  (rerouted originals, reset duplicates, redone downstream work, rolled-back iterations): what
  the protocol's recovery costs. The two sum to discarded_s / discarded_fraction;
- gpu_waste_fraction (a contract too) split in two shares of available_s that sum to it:
  discarded_waste_fraction = discarded_s / available_s and idle_fraction = idle_s /
  available_s (GPUs waiting, mostly for the network);
- iteration_s = training_time_s / iterations beside the iteration's physical lower bound
  (`sim.bound`, a property of the initial instance): `iteration_fields`;
- full_batch, short_iterations, short_detail (contracts): the invariant checker's account of the
  global batch (`protocol.invariants.BatchAccount`, the one the runtime audit reports too), read
  from it, not computed here.
Seconds are rounded to 9 significant digits and fractions to 6, never to fixed decimals: a tiny
model computes for milliseconds, and 3 decimals rounded its discarded_s to 0.0.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
from typing import Any

from gwtf.protocol.invariants import BatchAccount
from gwtf.protocol.kinds import RecordName as R
from gwtf.sim.bound import IterationBound

COUNTED = frozenset({R.REROUTE, R.REDO, R.MB_RESTART, R.RESET, R.ABANDONED, R.EVICT, R.JOIN, R.DUP_RETURN,
                     R.MB_INCOMPLETE, R.CHAIN_FAILED, R.LEADER_TAKEOVER, R.STAGE_LOST, R.SELF_STOP})
"""Records the summary counts, one counter each (a redo by its mode: redo_inflight, redo_aggregation)."""


def _sig(x: float, digits: int) -> float:
    """`x` rounded to `digits` significant digits."""
    return float(f"{x:.{digits}g}")


def _sig_or_none(x: float, digits: int) -> float | None:
    return _sig(x, digits) if math.isfinite(x) else None


def iteration_fields(training_time_s: float, iterations: int, bound: IterationBound) -> dict[str, Any]:
    """summary.json's time per iteration beside its lower bound (a contract, docs/simulator.md).

    `iteration_s` is null with no iteration completed, `achieved_over_bound` (4 decimals) null
    when either side is undefined (no iteration, a bound of 0 or infinite).
    """
    iteration_s = training_time_s / iterations if iterations > 0 else None
    b = bound.bound_s
    ratio = round(iteration_s / b, 4) if iteration_s is not None and 0 < b < math.inf else None
    return {
        "iteration_s": _sig(iteration_s, 9) if iteration_s is not None else None,
        "bound_s": _sig_or_none(b, 9),
        "bound_compute_s": _sig_or_none(bound.compute_s, 9),
        "bound_traffic_s": _sig_or_none(bound.traffic_s, 9),
        "bound_reduction_s": _sig_or_none(bound.reduction_s, 9),
        "bound_route_s": _sig_or_none(bound.route_s, 9),
        "bound_term": bound.term,
        "achieved_over_bound": ratio,
    }


class Metrics:
    def __init__(self, tokens_per_microbatch: int, full_batch: int = 0, batch: BatchAccount | None = None) -> None:
        """`batch`: the invariant checker's account of the global batch, fed by the checker;
        without it, one of its own over `full_batch` (data holders x microbatches, 0: unknown),
        fed here."""
        self.tokens_per_mb = tokens_per_microbatch
        self.batch = batch if batch is not None else BatchAccount(full_batch)
        self._feeds_batch = batch is None
        self.busy_s = 0.0
        self.mb_work: dict[int, dict[tuple[str, tuple[str, int]], float]] = {}
        self.useful_s = 0.0
        self.mb_compute_s = 0.0
        self.rows: list[dict[str, Any]] = []
        self.iter_start_s: dict[int, float] = {}
        self.counters: dict[str, int] = {}
        self.done_times: list[float] = []
        self.microbatches = 0
        self.crash_times: list[float] = []
        self.crashed: set[str] = set()
        self.join_times: list[float] = []  # a joiner became a member (its "join" record)
        self.alive_since: dict[str, float] = {}
        self.available_s = 0.0
        self.finished_at: float | None = None
        self._applied: set[tuple[int, int, int]] = set()
        self.discarded_s = 0.0
        self.discarded_crashed_s = 0.0
        self.last_done = -1
        self.started: dict[int, int] = {}
        self._decisions: dict[tuple[int, int, int], dict[str, Any]] = {}

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def node_up(self, node: str, now: float) -> None:
        self.alive_since.setdefault(node, now)

    def node_down(self, node: str, now: float) -> None:
        t0 = self.alive_since.pop(node, None)
        if t0 is not None:
            self.available_s += now - t0

    def node_crashed(self, node: str, now: float) -> None:
        """`node` crashed at `now` (after `node_down`): its unapplied work is the crash's share."""
        self.crashed.add(node)
        self.crash_times.append(now)

    def _discard(self, work: dict[tuple[str, tuple[str, int]], float]) -> None:
        self.discarded_s += sum(work.values())  # summed as before the split: same seconds, same bytes
        self.discarded_crashed_s += sum(v for (node, _mb), v in work.items() if node in self.crashed)

    def on_job(self, node: str, kind: str, mb: tuple[str, int, int] | None, dur_s: float) -> None:
        self.busy_s += dur_s
        if mb is not None:
            self.mb_compute_s += dur_s
            per = self.mb_work.setdefault(mb[1], {})
            key = (node, (mb[0], mb[2]))
            per[key] = per.get(key, 0.0) + dur_s

    def on_record(self, now: float, node: str, event: str, f: dict[str, Any]) -> None:
        if self._feeds_batch:
            self.batch.on_record(event, f)
        if event in COUNTED:  # the summary's counters are keyed by plain strings
            self.bump(str(event) if event != R.REDO else f"redo_{f.get('mode', '')}")
        if event == R.JOIN:
            self.join_times.append(now)
        if event == R.MB_START:
            self.started[f["mb"][1]] = self.started.get(f["mb"][1], 0) + 1
        elif event == R.ITER_START:
            self.iter_start_s[f["iteration"]] = now
        elif event == R.DECISION:
            self._decisions[(f["iteration"], f["round"], f["stage"])] = f["contributions"]
        elif event == R.STEP:
            key = (f["iteration"], f["round"], f["stage"])
            if key not in self._applied:
                self._applied.add(key)
                per = self.mb_work.get(f["iteration"], {})
                if f["stage"] == 0:  # started but not in the applied stage-0 update: dropped
                    covered = sum(len(v) for v in self._decisions.get(key, {}).values())
                    self.bump("microbatches_dropped", max(0, self.started.pop(f["iteration"], 0) - covered))
                for rep, mbs in self._decisions.get(key, {}).items():
                    for mb in mbs:
                        self.useful_s += per.pop((rep, tuple(mb)), 0.0)
        elif event == R.ITERATION_DONE:
            self._iteration_done(now, f)
        elif event == R.DH_LOST:
            self.bump("dh_lost")
        elif event == R.ROLLBACK:
            self.bump("rollbacks")
            self.bump("lost_iterations", f["lost_iterations"])
            for it in sorted(i for i in self.started if i >= f["version"]):
                self.bump("microbatches_dropped", self.started.pop(it))
            for it in sorted(i for i in self.mb_work if i >= f["version"]):
                self._discard(self.mb_work.pop(it))
        elif event == R.TRAINING_DONE:
            self.finished_at = now

    def _iteration_done(self, now: float, f: dict[str, Any]) -> None:
        it = f["iteration"]
        self.microbatches += f["expected"]
        self.done_times.append(now)
        start = self.iter_start_s.get(it, now)
        self.rows.append({"iteration": it, "start_s": round(start, 6), "end_s": round(now, 6),
                          "duration_s": round(now - start, 6), "microbatches": f["expected"],
                          "round": f["round"], "crashes_so_far": len(self.crash_times),
                          "dropped_so_far": self.counters.get("microbatches_dropped", 0),
                          "redo_so_far": self.counters.get("redo_inflight", 0)
                          + self.counters.get("redo_aggregation", 0)})
        self.last_done = it
        # the steps of iteration it-1 are all applied by now: what is left was never used
        self._discard(self.mb_work.pop(it - 1, {}))

    def summary(self, end_s: float, iterations_target: int) -> dict[str, Any]:
        for node in sorted(self.alive_since):
            self.node_down(node, end_s)
        training_time = self.finished_at if self.finished_at is not None else end_s
        unfinished = 0.0
        for it in sorted(self.mb_work):
            if it <= self.last_done:
                self._discard(self.mb_work[it])
            else:
                unfinished += sum(self.mb_work[it].values())
        self.mb_work.clear()
        discarded = self.discarded_s
        crashed = min(self.discarded_crashed_s, discarded)
        busy = max(self.busy_s - unfinished, 1e-12)
        idle = max(0.0, self.available_s - self.busy_s)
        avail = self.available_s
        recovery = self._recovery()
        batch = self.batch.fields()
        return {
            "training_time_s": round(training_time, 3),
            "iterations": len(self.rows),
            "full_batch": batch["full_batch"],
            "short_iterations": batch["short_iterations"],
            "short_detail": batch["short_detail"],  # the first ones: iteration, microbatches trained, cause
            "iterations_target": iterations_target,
            "finished": self.finished_at is not None,
            "microbatches": self.microbatches,
            "throughput_microbatches_per_s": round(self.microbatches / training_time, 6) if training_time else 0.0,
            "throughput_tokens_per_s": round(self.microbatches * self.tokens_per_mb / training_time, 3)
            if training_time else 0.0,
            "busy_s": _sig(self.busy_s, 9),
            "discarded_s": _sig(discarded, 9),
            "idle_s": _sig(idle, 9),
            "available_s": _sig(avail, 9),
            "discarded_fraction": _sig(discarded / busy, 6),
            "discarded_crashed_s": _sig(crashed, 9),
            "discarded_live_s": _sig(discarded - crashed, 9),
            "discarded_crashed_fraction": _sig(crashed / busy, 6),
            "discarded_live_fraction": _sig((discarded - crashed) / busy, 6),
            "gpu_waste_fraction": _sig((discarded + idle) / avail, 6) if avail else 0.0,
            "discarded_waste_fraction": _sig(discarded / avail, 6) if avail else 0.0,
            "idle_fraction": _sig(idle / avail, 6) if avail else 0.0,
            "recovery_time_mean_s": round(sum(recovery) / len(recovery), 3) if recovery else 0.0,
            "recovery_time_max_s": round(max(recovery), 3) if recovery else 0.0,
            "crashes": len(self.crash_times),
            "counters": dict(sorted(self.counters.items())),
        }

    def _recovery(self) -> list[float]:
        out = []
        j = 0
        for tc in sorted(self.crash_times):
            while j < len(self.done_times) and self.done_times[j] < tc:
                j += 1
            if j < len(self.done_times):
                out.append(self.done_times[j] - tc)
        return out

    def timeline_rows(self) -> list[dict[str, Any]]:
        return self.rows
