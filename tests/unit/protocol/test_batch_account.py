"""The invariant checker's account of the global batch (issue 42, `invariants.BatchAccount`):
every committed iteration's microbatches against the full batch (D x M), a crashed data
holder's microbatches served again (`reserved`) or not trained (`dropped`), and the cause of a
shortfall; from hand-built records and from a real run of the cores, where one dealt microbatch
taken out of the records (a leader that forgot it) is reported as a short iteration. A (shard,
index) trained twice stays a violation."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from core_harness import TRAIN, Harness, peers

from gwtf.config import ProtocolConfig
from gwtf.protocol.invariants import SHORT_LOST, SHORT_UNHELD, InvariantChecker
from gwtf.sim.metrics import Metrics

D, M = 2, 2
Pairs = list[tuple[int, int]]
Row = tuple[float, str, str, dict[str, Any]]


class Records:
    """Records of data holders d0 (the leader) and d1 and one relay stage (r1), M = 2."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.now = 0.0

    def add(self, writer: str, event: str, /, **fields: Any) -> None:
        self.now += 0.01
        self.rows.append((self.now, writer, event, fields))

    def iteration(self, it: int, served: dict[str, Pairs], lost: dict[str, Pairs] | None = None,
                  deal: int = 0, counted: int | None = None, started: int = -1) -> None:
        """Iteration `it` committed: each data holder of `served` trains its (shard, index) pairs
        as its microbatches 0, 1, ...; each one of `lost` starts its pairs, crashes, is evicted
        (the leader's `dh_lost` says `started`), and the leader deals `deal` microbatches."""
        for dh, pairs in (lost or {}).items():
            for n, data in enumerate(pairs):
                self.add(dh, "mb_start", mb=(dh, it, n), node=dh, data=data)
            self.add("d0", "evict", node=dh)
            self.add("d0", "dh_lost", node=dh, iteration=it, started=started)
        if deal:
            self.add("d0", "deal", iteration=it, items=deal, to=("d0",))
        mbs = {dh: [(dh, n) for n in range(len(pairs))] for dh, pairs in served.items()}
        for dh, pairs in served.items():
            for n, data in enumerate(pairs):
                self.add(dh, "mb_start", mb=(dh, it, n), node=dh, data=data)
        expected = tuple((dh, tuple(n for _, n in v)) for dh, v in sorted(mbs.items()))
        self.add("d0", "decision", iteration=it, round=1, stage=0, contributions=mbs, expected=expected)
        self.add("d0", "decision", iteration=it, round=1, stage=1,
                 contributions={"r1": [mb for v in mbs.values() for mb in v]}, expected=expected)
        total = sum(len(v) for v in served.values())
        self.add("d0", "iteration_done", iteration=it, round=1, expected=total if counted is None else counted)
        for dh in sorted(served):
            self.add(dh, "step", node=dh, stage=0, iteration=it, round=1, version=it + 1,
                     contributors=tuple(sorted(served)))
        self.add("r1", "step", node="r1", stage=1, iteration=it, round=1, version=it + 1, contributors=("r1",))

    def checked(self) -> InvariantChecker:
        chk = InvariantChecker(2, 1e9, 10, full_batch=D * M, microbatches=M)
        for now, node, event, fields in self.rows:
            chk.on_record(now, node, event, fields)
        return chk


OWN = {"d0": [(0, 0), (0, 1)], "d1": [(1, 0), (1, 1)]}  # both shards served by their data holders


def _fields(chk: InvariantChecker) -> tuple[int, int, int, list[dict[str, Any]]]:
    f = chk.batch.fields()
    return f["short_iterations"], f["reserved"], f["dropped"], f["short_detail"]


def test_a_full_iteration_is_neither_short_nor_lost() -> None:
    r = Records()
    r.iteration(0, OWN)
    chk = r.checked()
    assert chk.violations == [] and chk.batch.fields()["full_batch"] == 4
    assert _fields(chk) == (0, 0, 0, [])


def test_a_crashed_holders_microbatches_dealt_again_keep_the_batch_full_and_count_as_reserved() -> None:
    r = Records()
    r.iteration(0, OWN)
    # d1 started shard 1's first microbatch and crashed; the leader dealt its 2 to d0 (hold_batch)
    r.iteration(1, {"d0": [(0, 0), (0, 1), (1, 0), (1, 1)]}, lost={"d1": [(1, 0)]}, deal=2)
    chk = r.checked()
    assert chk.violations == []
    assert _fields(chk) == (0, 2, 0, [])


def test_without_the_batch_held_a_crash_shortens_its_iteration_by_its_dropped_microbatches() -> None:
    r = Records()
    r.iteration(0, OWN)
    r.iteration(1, {"d0": [(0, 0), (0, 1)]}, lost={"d1": [(1, 0), (1, 1)]})  # nobody serves shard 1
    r.iteration(2, {"d0": [(0, 0), (0, 1)]})  # shard 1 vacant, not dealt
    chk = r.checked()
    assert chk.violations == []  # the paper's behaviour: reported, not a violation
    assert _fields(chk) == (2, 0, 2, [{"iteration": 1, "microbatches": 2, "cause": SHORT_LOST},
                                      {"iteration": 2, "microbatches": 2, "cause": SHORT_UNHELD}])


def test_a_dealt_microbatch_never_trained_is_a_short_iteration_and_dropped() -> None:
    """The leader dealt d1's two microbatches but only one was trained (as if one Deal item was
    lost): every other invariant holds, the account still reports the iteration short."""
    r = Records()
    r.iteration(0, OWN)
    r.iteration(1, {"d0": [(0, 0), (0, 1), (1, 0)]}, lost={"d1": [(1, 0)]}, deal=2)
    chk = r.checked()
    assert chk.violations == []
    assert _fields(chk) == (1, 1, 1, [{"iteration": 1, "microbatches": 3, "cause": SHORT_LOST}])


def test_a_shard_index_trained_twice_is_a_violation_even_in_a_full_count() -> None:
    r = Records()
    r.iteration(0, {"d0": [(0, 0), (1, 0)], "d1": [(1, 0), (1, 1)]})  # (1, 0) twice, (0, 1) never
    chk = r.checked()
    kinds = {v.split(":", 1)[0] for v in chk.violations}
    assert {"data_twice", "batch_count"} <= kinds, chk.violations
    assert any("trained 3 distinct (shard, index) at stage 0 but counted 4" in v for v in chk.violations)


def test_a_loss_in_the_reduction_is_no_loss_and_a_new_leaders_commit_replaces_the_first() -> None:
    r = Records()
    r.add("d0", "dh_lost", node="d1", iteration=0, started=0)  # its gradient was in the reduction
    r.iteration(0, OWN)
    r.add("d0", "iteration_done", iteration=1, round=1, expected=2)  # a leader that died before its Steps
    r.iteration(1, OWN)  # its successor ran iteration 1 again: the full batch
    chk = r.checked()
    assert chk.violations == []
    assert _fields(chk) == (0, 0, 0, [])
    assert [c.iteration for c in chk.batch.committed.values()] == [0, 1]


def test_a_rerun_after_a_rollback_is_a_commit_of_its_own() -> None:
    r = Records()
    r.iteration(0, OWN)
    r.iteration(1, {"d0": [(0, 0), (0, 1)]}, lost={"d1": [(1, 0), (1, 1)]})
    r.add("d0", "rollback", version=1, lost_from=2, lost_iterations=1)
    r.iteration(1, {"d0": [(0, 0), (0, 1), (1, 0), (1, 1)]})  # with shard 1 dealt: full
    chk = r.checked()
    assert chk.violations == []
    short, reserved, dropped, detail = _fields(chk)
    assert (short, reserved, dropped) == (1, 0, 2) and detail[0]["iteration"] == 1  # the first run's
    assert chk.batch.fields(first=2)["short_iterations"] == 0


def test_the_simulators_metrics_read_the_checkers_account() -> None:
    r = Records()
    r.iteration(0, OWN)
    r.iteration(1, {"d0": [(0, 0), (0, 1)]}, lost={"d1": [(1, 0), (1, 1)]})
    chk = r.checked()
    metrics = Metrics(tokens_per_microbatch=1, batch=chk.batch)  # fed nothing itself
    s = metrics.summary(end_s=1.0, iterations_target=2)
    want = chk.batch.fields()
    assert {k: s[k] for k in ("full_batch", "short_iterations", "short_detail")} == \
        {k: want[k] for k in ("full_batch", "short_iterations", "short_detail")}
    assert (s["full_batch"], s["short_iterations"]) == (4, 1)


# ---- from a run of the cores -------------------------------------------------------------

SHARDED = replace(TRAIN, iterations=6, data_holders=D, microbatches=M)


def _run_with_a_data_holder_crash(cfg: ProtocolConfig | None = None) -> tuple[Harness, float]:
    """d1 crashes after it started a microbatch of iteration 2; no joiner: shard 1 stays vacant."""
    h = Harness(peers((2, 1, 1)), SHARDED, cfg=cfg)
    h.start()
    h.run(60.0, stop=lambda: any(f["mb"][0] == "d1" and f["mb"][1] == 2 for f in h.events("mb_start")))
    crashed_at = h.now
    h.crash("d1")
    h.run(h.now + 300.0, stop=lambda: bool(h.events("training_done")))
    h.run(h.now + 5.0)  # the last Step reaches every replica
    assert h.events("training_done")
    return h, crashed_at


def _check(rows: list[Row], crashed_at: float) -> InvariantChecker:
    chk = InvariantChecker(SHARDED.stages, 1e9, SHARDED.iterations, full_batch=D * M, microbatches=M)
    chk.on_dead("d1", crashed_at)
    for now, node, event, fields in rows:
        chk.on_record(now, node, event, fields)
    return chk


def _without(rows: list[Row], mb: tuple[str, int, int]) -> list[Row]:
    """The records as if microbatch `mb` had never been started: out of its iteration's decisions
    (contributions and expected) and count."""
    origin, it, n = mb
    out: list[Row] = []
    for now, node, event, f in rows:
        if event in ("mb_start", "contribute") and tuple(f["mb"]) == mb:
            continue
        if event == "decision" and f["iteration"] == it:
            f = {**f, "contributions": {rep: tuple(x for x in mbs if tuple(x) != (origin, n))
                                        for rep, mbs in f["contributions"].items()},
                 "expected": tuple((dh, tuple(i for i in idx if (dh, i) != (origin, n))) for dh, idx in f["expected"])}
        elif event == "iteration_done" and f["iteration"] == it:
            f = {**f, "expected": f["expected"] - 1}
        out.append((now, node, event, f))
    return out


def test_a_run_that_serves_a_crashed_holders_microbatches_again_and_one_that_forgot_one() -> None:
    h, crashed_at = _run_with_a_data_holder_crash()
    lost = h.events("dh_lost")
    assert [(f["node"], f["iteration"]) for f in lost] == [("d1", 2)], lost
    assert any(f["iteration"] == 2 for f in h.events("deal")), "the leader did not deal d1's microbatches"
    chk = _check(h.records, crashed_at)
    assert chk.violations == [], chk.violations
    fields = chk.batch.fields()
    assert (fields["short_iterations"], fields["dropped"]) == (0, 0), fields["short_detail"]
    assert fields["reserved"] == M and len(chk.batch.committed) == SHARDED.iterations

    # take one of the microbatches d0 was dealt in iteration 2 out of the records
    dealt = [tuple(f["mb"]) for f in h.events("mb_start") if f["mb"][0] == "d0" and f["mb"][1] == 2
             and tuple(f["data"])[0] == 1]
    assert dealt, "d0 served none of shard 1 in the crash's iteration"
    chk = _check(_without(h.records, dealt[-1]), crashed_at)
    assert chk.violations == [], chk.violations
    fields = chk.batch.fields()
    assert fields["short_detail"] == [{"iteration": 2, "microbatches": D * M - 1, "cause": SHORT_LOST}]
    assert (fields["reserved"], fields["dropped"]) == (M - 1, 1)


def test_a_run_without_the_batch_held_drops_the_crashed_holders_share() -> None:
    h, crashed_at = _run_with_a_data_holder_crash(ProtocolConfig(hold_batch=False, data_holder_joins=False))
    chk = _check(h.records, crashed_at)
    assert chk.violations == [], chk.violations
    fields = chk.batch.fields()
    # the crash's iteration and every one after it train shard 0 only
    assert fields["short_iterations"] == SHARDED.iterations - 2, fields["short_detail"]
    assert fields["short_detail"][0] == {"iteration": 2, "microbatches": M, "cause": SHORT_LOST}
    assert {d["cause"] for d in fields["short_detail"][1:]} == {SHORT_UNHELD}
    assert (fields["reserved"], fields["dropped"]) == (0, M)
