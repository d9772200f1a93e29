"""`gwtf audit DIR...`: the exactly-once audit of node folders built by hand (no network, no
processes but one subprocess per user-error check): a clean run, a double-counted microbatch,
diverged replicas, missing steps, several folders merged, a resumed node's appended records, the
config's sources and the user errors (exit 2, one line)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli_errors import assert_one_line_error, gwtf, gwtf_in_process

Rows = dict[str, list[dict[str, Any]]]

DH0 = "dh0~aaaa/local@127.0.0.1:7000"
R1A = "r1a~bbbb/local@127.0.0.1:7001"
R1B = "r1b~cccc/local@127.0.0.1:7002"
DH1 = "dh1~dddd/local@127.0.0.1:7003"
IDS = {"dh0": DH0, "r1a": R1A, "r1b": R1B, "dh1": DH1}
CONFIG = """[model]
stages = 2

[train]
data_holders = 1
microbatches = 2
iterations = 2
"""


class _Clock:
    """Wall clock and per-node process clocks of the hand-built records."""

    def __init__(self, unix_s: float = 1000.0) -> None:
        self.unix_s = unix_s
        self.started: dict[str, float] = {}

    def row(self, writer: str, event: str, **fields: Any) -> dict[str, Any]:
        """A record `writer` (a name of IDS) writes now."""
        self.unix_s += 0.01
        t0 = self.started.setdefault(writer, self.unix_s - 1.0)
        return {"event": event, **fields, "t_s": round(self.unix_s - t0, 4), "unix_s": round(self.unix_s, 4),
                "me": IDS[writer]}


def iteration(rows: Rows, clock: _Clock, it: int, hashes: tuple[str, str] = ("h1", "h1"),
              stage1: dict[str, list[list[object]]] | None = None, stepped_stage1: bool = True) -> None:
    """One iteration of a swarm of one data holder (dh0, stage 0, the leader) and two stage-1
    replicas (r1a, r1b), M = 2 microbatches: r1a serves microbatch 0, r1b microbatch 1."""
    def add(writer: str, event: str, **fields: Any) -> None:
        rows.setdefault(writer, []).append(clock.row(writer, event, **fields))

    add("dh0", "iter_start", iteration=it, members=3)
    for idx in (0, 1):
        add("dh0", "mb_start", mb=[DH0, it, idx], node=DH0, data=[0, 2 * it + idx])
    for idx, relay in ((0, "r1a"), (1, "r1b")):
        add(relay, "contribute", node=IDS[relay], stage=1, mb=[DH0, it, idx])
        add("dh0", "contribute", node=DH0, stage=0, mb=[DH0, it, idx])
    expected = [[DH0, [0, 1]]]
    add("dh0", "decision", iteration=it, round=1, stage=0, contributions={DH0: [[DH0, 0], [DH0, 1]]},
        expected=expected)
    add("dh0", "decision", iteration=it, round=1, stage=1,
        contributions=stage1 or {R1A: [[DH0, 0]], R1B: [[DH0, 1]]}, expected=expected)
    add("dh0", "iteration_done", iteration=it, round=1, expected=2)
    add("dh0", "stepped", iteration=it, stage=0, hash=f"h0-{it}", version=it + 1, microbatches=2)
    add("dh0", "step", node=DH0, stage=0, iteration=it, round=1, version=it + 1, contributors=[DH0])
    if stepped_stage1:
        for relay, h in zip(("r1a", "r1b"), hashes, strict=True):
            add(relay, "stepped", iteration=it, stage=1, hash=f"{h}-{it}", version=it + 1, microbatches=2)
            add(relay, "step", node=IDS[relay], stage=1, iteration=it, round=1, version=it + 1,
                contributors=[R1A, R1B])


def clean_run(clock: _Clock | None = None, **last: Any) -> Rows:
    """Two iterations and the leader's `training_done`; `last`: options of the last iteration."""
    clock = clock or _Clock()
    rows: Rows = {"dh0": [clock.row("dh0", "leader_term", node=DH0, term=0)]}
    iteration(rows, clock, 0)
    iteration(rows, clock, 1, **last)
    rows["dh0"].append(clock.row("dh0", "training_done", iterations=2))
    return rows


def write_run(out: Path, rows: Rows, config: str | None = CONFIG, status: dict[str, Any] | None = None) -> Path:
    """A `gwtf swarm --out` folder: nodes/<name>/records.jsonl (+ status.json), config.resolved.toml."""
    for name, rs in rows.items():
        d = out / "nodes" / name
        d.mkdir(parents=True, exist_ok=True)
        with (d / "records.jsonl").open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
        if status is not None:
            (d / "status.json").write_text(json.dumps(status), encoding="utf-8")
    if config is not None:
        (out / "config.resolved.toml").write_text(config, encoding="utf-8")
    return out


Audit = Callable[..., tuple[int, dict[str, Any]]]


@pytest.fixture
def audit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Audit:
    """`gwtf audit ARGS --json` in this process: (exit code, the JSON summary)."""
    def run(*args: str) -> tuple[int, dict[str, Any]]:
        capsys.readouterr()
        code, err = gwtf_in_process(tmp_path, "audit", *args, "--json")
        out = capsys.readouterr().out
        assert code in (0, 1), err
        return code, json.loads(out)

    return run


def test_a_clean_run_exits_0_with_the_totals(tmp_path: Path, audit: Audit, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", clean_run())
    code, s = audit(str(run))
    assert code == 0 and s["clean"] and s["violations"] == []
    assert (s["first"], s["end"], s["audited"], s["finished"]) == (0, 2, 2, True)
    assert (s["expected"], s["dropped"], s["hashed"], s["unhashed"]) == (2 * 2 * 2, 0, 4, 0)
    assert s["nodes"] == ["dh0", "r1a", "r1b"] and s["config"] == str(run / "config.resolved.toml")
    capsys.readouterr()
    assert gwtf_in_process(tmp_path, "audit", str(run))[0] == 0
    text = capsys.readouterr().out
    assert "iterations 0..1 audited" in text and "8 microbatch-stage contributions" in text
    assert text.rstrip().splitlines()[-1].startswith("clean: every microbatch counted exactly once")


def test_json_fields_are_stable(tmp_path: Path, audit: Audit) -> None:
    code, s = audit(str(write_run(tmp_path / "run", clean_run())))
    assert code == 0
    assert set(s) == {"clean", "violations", "notes", "folders", "nodes", "config", "stages", "data_holders",
                      "microbatches", "run_iterations", "first", "end", "audited", "finished", "expected", "dropped",
                      "reserved", "full_batch", "short_iterations", "short_detail", "hashed", "unhashed",
                      "unhashed_steps", "set_aside"}
    assert (s["stages"], s["data_holders"], s["microbatches"], s["run_iterations"]) == (2, 1, 2, 2)
    assert (s["full_batch"], s["short_iterations"], s["short_detail"], s["reserved"]) == (2, 0, [], 0)
    assert s["folders"] == [str(tmp_path / "run")] and s["notes"] == [] and s["unhashed_steps"] == []
    assert s["set_aside"] == 0


def two_holders_run(held: bool) -> Rows:
    """dh0 (the leader, shard 0) and dh1 (shard 1), M = 2, r1a serving stage 1 (r1b its other
    replica). Iteration 0 trains both shards; in iteration 1 dh1 starts its first microbatch and
    crashes: with the batch `held` the leader deals shard 1's two to dh0 (its microbatches 2, 3),
    else iteration 1 trains shard 0 alone (the paper's behaviour)."""
    clock = _Clock()
    rows: Rows = {"dh0": [clock.row("dh0", "leader_term", node=DH0, term=0)]}

    def add(writer: str, event: str, **fields: Any) -> None:
        rows.setdefault(writer, []).append(clock.row(writer, event, **fields))

    for it in (0, 1):
        add("dh0", "iter_start", iteration=it, members=4)
        served = {"dh0": [(0, 0), (0, 1)], "dh1": [(1, 0), (1, 1)]}
        if it == 1:
            add("dh1", "mb_start", mb=[DH1, it, 0], node=DH1, data=[1, 0])
            add("dh0", "evict", node=DH1)
            add("dh0", "dh_lost", node=DH1, iteration=it, started=-1)
            served = {"dh0": [(0, 0), (0, 1)] + ([(1, 0), (1, 1)] if held else [])}
            if held:
                add("dh0", "deal", iteration=it, items=2, to=[DH0])
        mbs = {IDS[dh]: [[IDS[dh], n] for n in range(len(pairs))] for dh, pairs in served.items()}
        for dh, pairs in served.items():
            for n, data in enumerate(pairs):
                add(dh, "mb_start", mb=[IDS[dh], it, n], node=IDS[dh], data=list(data))
                add("r1a", "contribute", node=R1A, stage=1, mb=[IDS[dh], it, n])
                add(dh, "contribute", node=IDS[dh], stage=0, mb=[IDS[dh], it, n])
        expected = [[o, [n for _, n in v]] for o, v in sorted(mbs.items())]
        add("dh0", "decision", iteration=it, round=1, stage=0, contributions=mbs, expected=expected)
        add("dh0", "decision", iteration=it, round=1, stage=1,
            contributions={R1A: [mb for v in mbs.values() for mb in v]}, expected=expected)
        add("dh0", "iteration_done", iteration=it, round=1, expected=sum(len(v) for v in mbs.values()))
        for dh in served:
            add(dh, "stepped", iteration=it, stage=0, hash=f"h0-{it}", version=it + 1, microbatches=2)
            add(dh, "step", node=IDS[dh], stage=0, iteration=it, round=1, version=it + 1,
                contributors=sorted(mbs))
        for relay in ("r1a", "r1b"):
            add(relay, "stepped", iteration=it, stage=1, hash=f"h1-{it}", version=it + 1, microbatches=2)
            add(relay, "step", node=IDS[relay], stage=1, iteration=it, round=1, version=it + 1, contributors=[R1A])
    add("dh0", "training_done", iterations=2)
    return rows


TWO_HOLDERS = CONFIG.replace("data_holders = 1", "data_holders = 2")


def test_a_crashed_holders_microbatches_served_again_are_re_served_not_dropped(
        tmp_path: Path, audit: Audit, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", two_holders_run(held=True), config=TWO_HOLDERS)
    code, s = audit(str(run))
    assert code == 0, s["violations"]
    assert (s["full_batch"], s["short_iterations"], s["short_detail"]) == (4, 0, [])
    assert (s["reserved"], s["dropped"], s["expected"]) == (2, 0, 2 * 4 * 2)
    capsys.readouterr()
    assert gwtf_in_process(tmp_path, "audit", str(run))[0] == 0
    text = capsys.readouterr().out
    assert "the full batch (4 microbatches) in every iteration" in text
    assert "microbatches of crashed data holders: 2 re-served, 0 dropped" in text
    assert "short:" not in text and "dropped with crashed" not in text


def test_without_the_batch_held_the_short_iteration_is_named_with_its_cause(
        tmp_path: Path, audit: Audit, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", two_holders_run(held=False), config=TWO_HOLDERS)
    code, s = audit(str(run))
    assert code == 0, s["violations"]  # the paper's behaviour: a shortfall, not a violation
    assert (s["full_batch"], s["short_iterations"], s["reserved"], s["dropped"]) == (4, 1, 0, 2)
    assert s["short_detail"] == [{"iteration": 1, "microbatches": 2, "cause": "a data holder lost in it"}]
    capsys.readouterr()
    assert gwtf_in_process(tmp_path, "audit", str(run))[0] == 0
    text = capsys.readouterr().out
    assert "1 iteration short of the full batch (4 microbatches)" in text and "0 re-served, 2 dropped" in text
    assert "short: iteration 1: 2 of 4 microbatches trained (a data holder lost in it)" in text


def test_a_leader_that_counts_more_than_it_trained_is_a_violation(tmp_path: Path, audit: Audit) -> None:
    rows = two_holders_run(held=True)
    done = next(r for r in rows["dh0"] if r["event"] == "iteration_done" and r["iteration"] == 1)
    shard1 = [r for r in rows["dh0"] if r["event"] == "mb_start" and r["data"] == [1, 1]]
    shard1[0]["data"] = [1, 0]  # dh0 trained shard 1's microbatch 0 twice, never its 1
    code, s = audit(str(write_run(tmp_path / "run", rows, config=TWO_HOLDERS)))
    assert code == 1 and done["expected"] == 4
    assert any("batch_count: iteration 1 trained 3 distinct" in v for v in s["violations"]), s["violations"]
    assert any("data_twice: shard 1 index 0" in v for v in s["violations"]), s["violations"]


def test_a_double_counted_microbatch_exits_1(tmp_path: Path, audit: Audit, capsys: pytest.CaptureFixture[str]) -> None:
    rows = clean_run(stage1={R1A: [[DH0, 0], [DH0, 1]], R1B: [[DH0, 1]]})
    run = write_run(tmp_path / "run", rows)
    code, s = audit(str(run))
    assert code == 1 and not s["clean"]
    assert any(v.startswith("iteration 1 stage 1: counted twice") for v in s["violations"]), s["violations"]
    capsys.readouterr()
    assert gwtf_in_process(tmp_path, "audit", str(run))[0] == 1
    assert "exactly-once ledger violated" in capsys.readouterr().out


def test_differing_replica_hashes_exit_1(tmp_path: Path, audit: Audit) -> None:
    code, s = audit(str(write_run(tmp_path / "run", clean_run(hashes=("h1", "other")))))
    assert code == 1
    assert [v for v in s["violations"] if "replicas diverged" in v] == [
        "iteration 1 stage 1: replicas diverged {'r1a': 'h1-1', 'r1b': 'other-1'}"]


def test_a_step_no_replica_logged_is_never_skipped_silently(tmp_path: Path, audit: Audit) -> None:
    """No `stepped` record of stage 1 in iteration 1: a violation. The one accepted case, a
    stage restored from that very step's checkpoint, is named and counted, not hidden."""
    code, s = audit(str(write_run(tmp_path / "a", clean_run(stepped_stage1=False))))
    assert code == 1 and "iteration 1 stage 1: no replica logged its step" in s["violations"]
    assert s["hashed"] == 3

    clock = _Clock()
    rows = clean_run(clock, stepped_stage1=False)
    rows["dh0"].insert(-1, clock.row("dh0", "rollback", lost_from=2, version=2, lost_iterations=0))
    code, s = audit(str(write_run(tmp_path / "b", rows)))
    assert code == 0, s["violations"]
    assert s["unhashed"] == 1 and s["unhashed_steps"] == [[1, 1]] and s["hashed"] == 3
    assert any("iteration 1 stage 1: no replica logged its step" in n and "not compared" in n for n in s["notes"])


def test_several_folders_are_merged_and_one_node_name_is_told_apart_by_its_id(tmp_path: Path, audit: Audit) -> None:
    rows = clean_run()
    a = write_run(tmp_path / "a", {"dh0": rows["dh0"]})
    write_run(tmp_path / "b", {"r1a": rows["r1a"]}, config=None)
    (tmp_path / "c" / "nodes").mkdir(parents=True)
    write_run(tmp_path / "c" / "x", {"r1a": rows["r1b"]}, config=None)  # machine C named its node r1a too
    node = tmp_path / "c" / "x" / "nodes" / "r1a"
    code, s = audit(str(a), str(tmp_path / "b"), str(node), str(a / "nodes" / "dh0"))  # dh0 given twice
    assert code == 0, s["violations"]
    assert s["nodes"] == sorted(["dh0", R1A, R1B]) and s["expected"] == 8

    write_run(tmp_path / "d", {"r1a": rows["r1a"]}, config=None)  # r1a's folder gathered twice
    proc_code, err = gwtf_in_process(tmp_path, "audit", str(a), str(tmp_path / "b"), str(tmp_path / "d"))
    assert proc_code == 2 and "node r1a appears in 2 folders" in err and len(err.strip().splitlines()) == 1


def test_a_missing_machine_is_named(tmp_path: Path, audit: Audit) -> None:
    rows = clean_run()
    code, s = audit(str(write_run(tmp_path / "run", {"dh0": rows["dh0"], "r1a": rows["r1a"]})))
    assert code == 1
    assert any(n.startswith("no records of 1 nodes the decisions credit (r1b)") for n in s["notes"])


def test_records_of_an_earlier_start_are_set_aside(tmp_path: Path, audit: Audit) -> None:
    """Every node restarted with --resume at version 1 appends to its records.jsonl: the first
    start (iteration 0, and iteration 1 cut short) is not audited, the newest from iteration 1."""
    clock = _Clock(1000.0)
    old: Rows = {"dh0": [clock.row("dh0", "leader_term", node=DH0, term=0)]}
    iteration(old, clock, 0)
    old["dh0"].append(clock.row("dh0", "iter_start", iteration=1, members=3))
    clock = _Clock(2000.0)  # new processes: their t_s start again
    new: Rows = {"dh0": [clock.row("dh0", "leader_term", node=DH0, term=0)]}
    iteration(new, clock, 1)
    new["dh0"].append(clock.row("dh0", "training_done", iterations=2))
    run = write_run(tmp_path / "run", old)
    write_run(run, new)
    code, s = audit(str(run))
    assert code == 0, s["violations"]
    assert (s["first"], s["end"], s["expected"]) == (1, 2, 4)
    assert s["set_aside"] == sum(map(len, old.values())) and "set aside" in s["notes"][0]


def test_an_unfinished_run_is_audited_up_to_its_last_step_of_every_stage(tmp_path: Path, audit: Audit) -> None:
    rows = clean_run()
    rows["dh0"].pop()  # no training_done: the leader was killed
    rows["r1b"] = [r for r in rows["r1b"] if r.get("iteration") != 1]  # r1b died before stepping 1
    rows["r1a"] = [r for r in rows["r1a"] if r.get("iteration") != 1]
    code, s = audit(str(write_run(tmp_path / "run", rows)))
    assert code == 0, s["violations"]
    assert (s["first"], s["end"], s["finished"]) == (0, 1, False)
    assert any("iterations from 1 on are incomplete" in n for n in s["notes"])


def test_the_config_comes_from_the_flags_when_no_resolved_config_is_found(tmp_path: Path, audit: Audit) -> None:
    run = write_run(tmp_path / "run", clean_run(), config=None)
    code, err = gwtf_in_process(tmp_path, "audit", str(run))
    assert code == 2 and "no config.resolved.toml found" in err and "--config" in err
    (tmp_path / "swarm.toml").write_text(CONFIG.replace("iterations = 2", "iterations = 9"), encoding="utf-8")
    code, s = audit(str(run), "--config", str(tmp_path / "swarm.toml"), "--set", "train.iterations=2")
    assert code == 0 and s["config"] == str(tmp_path / "swarm.toml")


@pytest.mark.parametrize("make, needles", [
    (lambda p: None, ("no such folder",)),
    (lambda p: p.mkdir(), ("no records found",)),
    (lambda p: write_run(p, {"dh0": []}), ("no records found", "empty")),
    (lambda p: write_run(p, clean_run(), config="[model\n"), ("not valid TOML",)),
    (lambda p: write_run(p, clean_run(), status={"stages": 3, "iterations": 2}), ("status.json says stages 3",)),
    (lambda p: write_run(p, clean_run(), config=CONFIG.replace("iterations = 2", "iterations = 5")),
     ("training_done record says 2 iterations", "train.iterations = 5")),
    (lambda p: write_run(p, {"dh0": [{"event": "decision", "iteration": 0, "stage": 0, "round": 1},
                                      {"event": "training_done", "iterations": 2}]}), ("malformed records",)),
])
def test_user_errors_exit_2_with_one_line(tmp_path: Path, make: Callable[[Path], object],
                                          needles: tuple[str, ...]) -> None:
    make(tmp_path / "run")
    code, err = gwtf_in_process(tmp_path, "audit", str(tmp_path / "run"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gwtf: error: "), err
    assert all(n in lines[0] for n in needles), lines[0]


def test_a_missing_folder_exits_2_with_one_line_in_a_subprocess(tmp_path: Path) -> None:
    assert_one_line_error(gwtf(tmp_path, "audit", str(tmp_path / "nope")), "no such folder")
