"""The exactly-once ledger, checked from a swarm's node logs alone (DESIGN.md section 3).

Owns `audit_run(records, stages, microbatches, iterations, first, run_iterations, data_holders)`,
the one audit both `gwtf swarm` (`Swarm.audit`) and `gwtf audit` run: the ledger (`audit_ledger`)
with the replica hashes taken from the records themselves (`current_step_hashes`), plus the
invariant replay, and totals that say how many steps had their hashes compared (`unhashed_steps`:
the only steps the ledger accepts without a logged hash) and what every iteration trained of
the global batch (the checker's `BatchAccount`, the one the simulator's summary reads: the full
batch, the iterations short of it with their causes, and the microbatches of crashed data
holders served again, `reserved`, or not trained, `dropped`), worded for both commands by
`batch_text` and `short_lines`. `audit_ledger(records, iterations, stages,
hashes)` checks, for every finished iteration and stage,
the leader's final aggregation decision (the `decision` record of the highest round) must cover
every expected microbatch exactly once (a crashed data holder's dropped microbatches may appear
at most once: relay contributions made before the crash stay); every contributor must have logged (`contribute`) each
microbatch it was credited with; and every replica that stepped (`stepped`, written by the node
driver with the new weights' hash) must hold the same weights. Expected microbatches exclude
those of a crashed data holder (the leader's `dh_lost` record: served again by the live data
holders, `protocol.hold_batch`, under other ids, or dropped).

It also replays every node's records, in wall-clock order, through the simulator's own
`InvariantChecker` (`replay_invariants`): the same checks of exactly-once decisions, identical
steps per (stage, version), one leader per term and the global batch's account hold for real
processes as for simulated ones.

`gwtf swarm` runs it at the end of a run, `gwtf audit` on gathered node folders (where
`latest_attempt` first sets aside the records of earlier swarm starts that `gwtf node --resume`
appends to); the integration tests assert it. Reads plain dicts (the rows of
`DIR/nodes/*/records.jsonl`). Must not import torch or asyncio.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from gwtf.protocol.invariants import InvariantChecker
from gwtf.protocol.kinds import RecordName

Records = Mapping[str, Sequence[Mapping[str, Any]]]
_DRIVER_FIELDS = frozenset({"event", "t_s", "unix_s", "me"})  # what the node driver adds to a core Record


def current_step_hashes(records: Records) -> dict[tuple[int, int], dict[str, str]]:
    """(iteration, stage) -> node -> weights hash of the step that stands: a rollback to version v
    (a stage was lost) voids every step of iterations >= v logged before it, since those
    iterations run again (with other replicas, so other summation groups: not bit-equal)."""
    rollbacks = [(float(r.get("unix_s", 0.0)), int(r["version"])) for rows in records.values() for r in rows
                 if r.get("event") == RecordName.ROLLBACK]
    out: dict[tuple[int, int], dict[str, str]] = {}
    for name, rows in records.items():
        for r in rows:
            if r.get("event") != RecordName.STEPPED:
                continue
            it, at = int(r["iteration"]), float(r.get("unix_s", 0.0))
            if any(t > at and v <= it for t, v in rollbacks):
                continue
            out.setdefault((it, int(r["stage"])), {})[name] = str(r["hash"])
    return out


def replay(records: Records, stages: int, run_iterations: int = 0, data_holders: int = 0,
           microbatches: int = 0) -> InvariantChecker:
    """The simulator's invariant checker over the nodes' records, merged by wall clock (one
    machine's clock on loopback; across hosts, skew only reorders records of different nodes
    that are causally far apart). Liveness is the launcher's to judge (finished or timed out).
    `data_holders` x `microbatches`: the global batch (0: unknown) its `batch` accounts for."""
    rows = sorted((float(r.get("unix_s", 0.0)), i, name, r)
                  for name, rs in records.items() for i, r in enumerate(rs) if "event" in r)
    checker = InvariantChecker(stages, progress_bound_s=float("inf"), iterations=run_iterations,
                               full_batch=data_holders * microbatches, microbatches=microbatches)
    for t, _, name, r in rows:
        fields = {k: v for k, v in r.items() if k not in _DRIVER_FIELDS}
        checker.on_record(t, str(r.get("me") or name), str(r["event"]), fields)
    return checker


def replay_invariants(records: Records, stages: int, run_iterations: int = 0) -> list[str]:
    """The violations `replay` finds."""
    return list(replay(records, stages, run_iterations).violations)


def final_decisions(records: Records) -> dict[tuple[int, int], Mapping[str, Any]]:
    """The highest-round `decision` record per (iteration, stage), from whichever node led."""
    out: dict[tuple[int, int], Mapping[str, Any]] = {}
    for rows in records.values():
        for r in rows:
            if r.get("event") != RecordName.DECISION:
                continue
            key = (int(r["iteration"]), int(r["stage"]))
            if key not in out or r["round"] > out[key]["round"]:
                out[key] = r
    return out


def _contributions(records: Records) -> dict[str, Counter[tuple[str, int, int, int]]]:
    out: dict[str, Counter[tuple[str, int, int, int]]] = {}
    for rows in records.values():
        for r in rows:
            if r.get("event") == RecordName.CONTRIBUTE:
                origin, it, idx = r["mb"]
                out.setdefault(str(r["node"]), Counter())[(origin, int(it), int(idx), int(r["stage"]))] += 1
    return out


def dropped_by(row: Mapping[str, Any], microbatches: int) -> int:
    """Microbatches a `dh_lost` record names lost with the holder (served again in the iteration
    with the batch held, else dropped): those it started, all M if it never said."""
    started = int(row.get("started", -1))
    return started if started >= 0 else microbatches


def audit_ledger(
    records: Records, iterations: int, stages: int, hashes: Mapping[tuple[int, int], Mapping[str, str]],
    microbatches: int = 0, first: int = 0, run_iterations: int = 0, data_holders: int = 0,
) -> tuple[list[str], dict[str, int]]:
    """Check iterations first..iterations-1 (a resumed swarm's records start at `first`).
    Returns (violations, totals); no violations = exactly once.

    `hashes`: (iteration, stage) -> node -> weights hash after that step; `microbatches`: M;
    `data_holders`: D. totals: `expected` microbatch-stage pairs, `dropped` microbatches of
    crashed data holders that no committed iteration trained (the checker's `BatchAccount`);
    with `data_holders` 0 (the global batch unknown) every microbatch the leader's `dh_lost`
    records name, served again or not.
    """
    problems, totals, _ = _audit(records, iterations, stages, hashes, microbatches, first, run_iterations,
                                 data_holders)
    return problems, totals


def _audit(
    records: Records, iterations: int, stages: int, hashes: Mapping[tuple[int, int], Mapping[str, str]],
    microbatches: int, first: int, run_iterations: int, data_holders: int,
) -> tuple[list[str], dict[str, int], InvariantChecker]:
    """`audit_ledger`, and the checker its invariant replay ran."""
    problems, totals = _ledger(records, iterations, stages, hashes, microbatches, first)
    checker = replay(records, stages, run_iterations, data_holders, microbatches)
    problems += [f"invariant: {v}" for v in checker.violations]
    if data_holders:
        totals["dropped"] = checker.batch.fields(first, iterations)["dropped"]
    return problems, totals, checker


def _ledger(
    records: Records, iterations: int, stages: int, hashes: Mapping[tuple[int, int], Mapping[str, str]],
    microbatches: int, first: int,
) -> tuple[list[str], dict[str, int]]:
    """The ledger's own checks of `audit_ledger` (no replay); `dropped`: what `dh_lost` names."""
    problems: list[str] = []
    standing = current_step_hashes(records)
    restored = {int(r["version"]) for rows in records.values() for r in rows if r.get("event") == RecordName.ROLLBACK}
    decisions = final_decisions(records)
    logged = _contributions(records)
    totals: dict[str, int] = {"expected": 0, "dropped": 0}
    lost: set[tuple[int, str]] = set()  # (iteration, data holder) lost (`dh_lost`)
    for rows in records.values():
        for r in rows:
            if r.get("event") == RecordName.DH_LOST:
                totals["dropped"] += dropped_by(r, microbatches)
                lost.add((int(r["iteration"]), str(r["node"])))
    for it in range(first, iterations):
        for stage in range(stages):
            d = decisions.get((it, stage))
            if d is None:
                problems.append(f"iteration {it} stage {stage}: no aggregation decision")
                continue
            expected = sorted((dh, int(i)) for dh, idxs in d["expected"] for i in idxs)
            covered = sorted((o, int(i)) for mbs in d["contributions"].values() for o, i in mbs)
            counts = Counter(covered)
            twice = sorted(mb for mb, n in counts.items() if n > 1)
            missing = sorted((Counter(expected) - counts).elements())
            # a crashed data holder's microbatches leave the iteration (served again under other
            # ids, or dropped); contributions relays already made for them may stay, at most once
            # (docs/protocol.md), anything else is unexpected
            unexpected = sorted(mb for mb in counts if mb not in set(expected) and (it, mb[0]) not in lost)
            if twice or missing or unexpected:
                problems.append(f"iteration {it} stage {stage}: counted twice {twice}, missing {missing}, "
                                f"unexpected {unexpected}")
            for node, mbs in d["contributions"].items():
                mine = logged.get(node, Counter())
                absent = [(o, i) for o, i in mbs if mine[(o, it, int(i), stage)] < 1]
                if absent:
                    problems.append(f"iteration {it} stage {stage}: {node} credited with unlogged {absent}")
            step_hashes = standing.get((it, stage), {}) if standing else hashes.get((it, stage), {})
            if not step_hashes and it + 1 not in restored:
                # (a stage whose last replica died right after this step, before its driver
                # logged it, and was restored from this very step's checkpoint is accounted for)
                problems.append(f"iteration {it} stage {stage}: no replica logged its step")
            elif step_hashes and len(set(step_hashes.values())) != 1:
                problems.append(f"iteration {it} stage {stage}: replicas diverged {dict(step_hashes)}")
            totals["expected"] += len(expected)
    return problems, totals


def unhashed_steps(records: Records, stages: int, iterations: int, first: int = 0) -> list[tuple[int, int]]:
    """(iteration, stage) steps of first..iterations-1 that no replica logged (no standing
    `stepped` hash) but that `audit_ledger` accepts: the stage was restored from the checkpoint
    of that very step (a `rollback` to version iteration+1: its last replica died right after
    stepping, before its driver logged it). Their replica hashes cannot be compared."""
    standing = current_step_hashes(records)
    restored = {int(r["version"]) for rows in records.values() for r in rows if r.get("event") == RecordName.ROLLBACK}
    return [(it, k) for it in range(first, iterations) for k in range(stages)
            if not standing.get((it, k)) and it + 1 in restored]


def audit_run(
    records: Records, stages: int, microbatches: int, iterations: int, first: int = 0, run_iterations: int = 0,
    data_holders: int = 0,
) -> tuple[list[str], dict[str, Any]]:
    """The audit of iterations first..iterations-1 of one swarm run from its nodes' records
    (`gwtf swarm` and `gwtf audit` alike): `audit_ledger` with the standing step hashes of the
    records, and the invariant replay. Returns (violations, totals); totals: `expected`,
    `dropped` (see `audit_ledger`), `hashed` (steps whose replicas' hashes were compared: some
    replica logged the step), `unhashed` (steps accepted without a hash: `unhashed_steps`), and
    the global batch's account (`BatchAccount.fields`, every commit of those iterations):
    `full_batch` (D x M; 0 with `data_holders` 0, unknown: nothing is short then),
    `short_iterations`, `short_detail` (the first ones: iteration, microbatches trained, cause)
    and `reserved` (microbatches of crashed data holders served again and trained)."""
    hashes = current_step_hashes(records)
    problems, ledger, checker = _audit(records, iterations, stages, hashes, microbatches, first, run_iterations,
                                       data_holders)
    batch = checker.batch.fields(first, iterations)
    totals: dict[str, Any] = {**ledger, **{k: batch[k] for k in BATCH_KEYS}}
    totals["hashed"] = sum(1 for it in range(first, iterations) for k in range(stages) if hashes.get((it, k)))
    totals["unhashed"] = len(unhashed_steps(records, stages, iterations, first))
    return problems, totals


BATCH_KEYS = ("full_batch", "short_iterations", "short_detail", "reserved")
"""The totals `audit_run` adds from the global batch's account (`dropped` is the ledger's own key)."""


def batch_text(totals: Mapping[str, Any]) -> str:
    """The global batch of an audit's totals in words (`gwtf audit` and `gwtf swarm` print it)."""
    full, short = int(totals.get("full_batch", 0)), int(totals.get("short_iterations", 0))
    reserved, dropped = int(totals.get("reserved", 0)), int(totals.get("dropped", 0))
    if not full:  # the global batch unknown: nothing is known short or served again
        return f"{dropped} microbatches lost with crashed data holders"
    held = (f"the full batch ({full} microbatches) in every iteration" if not short
            else f"{short} iteration{'s' if short != 1 else ''} short of the full batch ({full} microbatches)")
    return f"{held}; microbatches of crashed data holders: {reserved} re-served, {dropped} dropped"


def short_lines(totals: Mapping[str, Any]) -> list[str]:
    """One line per short iteration the totals detail (the first ones), and how many more."""
    detail = list(totals.get("short_detail", ()))
    out = [f"iteration {d['iteration']}: {d['microbatches']} of {totals.get('full_batch', 0)} microbatches "
           f"trained ({d['cause']})" for d in detail]
    more = int(totals.get("short_iterations", 0)) - len(detail)
    return out + ([f"... and {more} more short iterations"] if more > 0 else [])


def process_runs(rows: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """A node's records split by process start: `t_s` (seconds since the node process started)
    goes back at each start; one records.jsonl holds several when `gwtf node --resume` reused
    the node's folder."""
    runs: list[list[Mapping[str, Any]]] = []
    last = float("inf")
    for r in rows:
        t = r.get("t_s")
        t_s = float(t) if isinstance(t, (int, float)) else last
        if not runs or t_s < last:
            runs.append([])
        runs[-1].append(r)
        last = t_s
    return runs


def latest_attempt(records: Records) -> tuple[dict[str, list[Mapping[str, Any]]], int]:
    """The records of the newest swarm start only, and how many rows were set aside. A swarm
    starts when its bootstrap node leads term 0 (`leader_term`, term 0: elections only raise the
    term), so two such records mean the records hold two attempts (a `gwtf node --resume`
    appends to the folder of the stopped run). Kept: every node's process runs (`process_runs`)
    still writing at the newest start; a run that ended before it belongs to an earlier attempt.
    One start (the usual case, and `gwtf swarm`'s own `nodes/`): the records unchanged."""
    starts = [float(r.get("unix_s", 0.0)) for rows in records.values() for r in rows
              if r.get("event") == RecordName.LEADER_TERM and r.get("term") == 0]
    if len(starts) < 2:
        return {name: list(rows) for name, rows in records.items()}, 0
    newest, skipped = max(starts), 0
    out: dict[str, list[Mapping[str, Any]]] = {}
    for name, rows in records.items():
        kept: list[Mapping[str, Any]] = []
        for run in process_runs(rows):
            if float(run[-1].get("unix_s", 0.0)) >= newest:
                kept += run
            else:
                skipped += len(run)
        if kept:
            out[name] = kept
    return out, skipped
