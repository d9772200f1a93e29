"""The one fault grammar (`gwtf.protocol.faults`, docs/faults.md): both written forms parse to
equal `Fault`s and round-trip, a bad spec is one line naming the bad part, and `FaultWatch`
counts exactly as documented: per fault, over every point fed, firing once on match `count`.
Also: the simulator and a node process refuse what they cannot carry out, the scenario's
`[[faults]]` tables keep loading unchanged, and the base simulator now fires compute triggers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gwtf.errors import UserError
from gwtf.protocol.faults import ACTIONS, Fault, FaultError, FaultWatch, parse_fault
from gwtf.protocol.kinds import ComputeKind, RecordName
from gwtf.protocol.messages import Compute
from gwtf.runtime.chaos import FAULT_ENV, fault_from, runtime_fault
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "smoke.toml"
PAIRS = [
    ("crash:after=step:count=2", {"event": "crash", "after_event": "step", "count": 2}),
    ("crash:t=3.5:node=n2", {"event": "crash", "time_s": 3.5, "node": "n2"}),
    ("crash:after=contribute:count=7", {"event": "crash", "after_event": "contribute", "count": 7}),
    ("cut:t=2:node=n1:peer=n9:duration_s=18.5",
     {"event": "cut", "time_s": 2.0, "node": "n1", "peer": "n9", "duration_s": 18.5}),
    ("degrade:after=iter_start:node=n4:peer=n6", {"event": "degrade", "after_event": "iter_start", "node": "n4",
                                                  "peer": "n6"}),
    ("crash_stage:t=4:stage=2", {"event": "crash_stage", "time_s": 4.0, "stage": 2}),
    ("join:t=7.25", {"event": "join", "time_s": 7.25}),
    ("leave:after=mb_start:node=n3:count=3", {"event": "leave", "after_event": "mb_start", "node": "n3", "count": 3}),
    ("crash:compute=forward:iter=2:mb=1", {"event": "crash", "after_compute": "forward", "iteration": 2, "mb": 1}),
    ("flip:compute=forward:from=2", {"event": "flip", "after_compute": "forward", "from_iteration": 2}),
    ("crash:compute=aggregate:stage=1:iteration=2", {"event": "crash", "after_compute": "aggregate", "stage": 1,
                                                     "iteration": 2}),
]


@pytest.mark.parametrize(("spec", "table"), PAIRS, ids=[p[0] for p in PAIRS])
def test_both_forms_parse_to_equal_faults_and_round_trip(spec: str, table: dict[str, object]) -> None:
    a, b = parse_fault(spec), parse_fault(table)
    assert a == b == Fault(**table)  # type: ignore[arg-type]
    assert parse_fault(a.spec()) == a and parse_fault(a.table()) == a
    assert a.table() == table | {k: float(v) for k, v in table.items() if k in ("time_s", "duration_s")}


def test_spec_is_canonical_short_keys() -> None:
    f = parse_fault("crash:after_event=step:iteration=3:from_iteration=1")
    assert f.spec() == "crash:after=step:iter=3:from=1"
    assert parse_fault("crash:t=0").spec() == "crash:t=0.0"


def test_scenario_tables_and_strings_load_the_same(tmp_path: Path) -> None:
    """The scenario's existing `[[faults]]` keys keep working; a compact string is an entry too."""
    path = tmp_path / "s.toml"
    path.write_text('[[faults]]\nevent = "crash"\nafter_event = "contribute"\ncount = 7\n\n'
                    '[[faults]]\nevent = "cut"\nnode = "n1"\npeer = "n2"\ntime_s = 2.5\nduration_s = 4.0\n',
                    encoding="utf-8")
    from_tables = load_scenario(path).faults
    from_strings = load_scenario(None, ['faults=["crash:after=contribute:count=7", '
                                        '"cut:t=2.5:node=n1:peer=n2:duration_s=4"]']).faults
    assert from_tables == from_strings
    assert from_tables == (Fault(event="crash", after_event="contribute", count=7),
                           Fault(event="cut", node="n1", peer="n2", time_s=2.5, duration_s=4.0))


BAD = [
    ("", "expected <action>:<trigger>"),
    ("crash", "expected <action>:<trigger>"),
    ("kill:compute=forward", "unknown action 'kill' (the old kill: is crash:)"),
    ("explode:t=1", "unknown action 'explode'"),
    ("crash:forward", "trigger 'forward': write compute=forward (a compute job)"),
    ("crash:step", "write after=step (a record) or compute=step (a compute job)"),
    ("crash:soon", "trigger 'soon': expected t=SECONDS, after=RECORD or compute=KIND"),
    ("crash:t=x", "t must be a number, got 'x'"),
    ("crash:t=-1", "time_s must be >= 0"),
    ("crash:after=nope", "after_event 'nope' is not a record name"),
    ("crash:compute=nope", "after_compute 'nope' is not a compute kind"),
    ("crash:after=step:after=1", "'after=1' is a second trigger (to skip matches use count=N"),
    ("crash:after=step:t=3", "'t=3' is a second trigger"),
    ("crash:after=step:count=0", "count must be >= 1"),
    ("crash:after=step:count=two", "count must be an integer, got 'two'"),
    ("crash:after=step:iter=", "iter must be an integer, got ''"),
    ("crash:after=step:color=red", "unknown key 'color=red'"),
    ("crash:after=step:node", "unknown key 'node'"),
    ("crash:after=step:node=a:node=b", "node given twice"),
    ("crash:t=1:node=", "node is empty"),
    ("cut:t=1:node=a", "peer is needed by cut"),
    ("crash_stage:t=1", "stage is needed by crash_stage"),
    ("cut:t=1:node=a:peer=b:duration_s=0", "duration_s must be > 0"),
]


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[b[0] or "empty" for b in BAD])
def test_a_bad_spec_is_one_line_naming_the_bad_part(spec: str, message: str) -> None:
    with pytest.raises(FaultError) as err:
        parse_fault(spec, "runtime.fault")
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"runtime.fault {spec!r}:"), text
    assert message in text, text
    assert isinstance(err.value, ValueError) and isinstance(err.value, UserError)  # the CLI: exit 2


def test_a_bad_table_names_the_key() -> None:
    with pytest.raises(FaultError, match=r"^scenario: unknown key 'faults\[2\]\.colour'$"):
        parse_fault({"event": "crash", "colour": 1}, "scenario", "faults[2]")
    with pytest.raises(FaultError, match=r"^scenario: faults.count must be >= 1$"):
        parse_fault({"event": "crash", "after_event": "step", "count": 0}, "scenario")
    with pytest.raises(FaultError, match="faults.time_s is a third trigger"):
        parse_fault({"event": "crash", "after_event": "step", "time_s": 3.0})
    with pytest.raises(UserError, match=r"scenario: faults\[0\].*event"):
        load_scenario(None, ['faults=[{event="explode"}]'])


def test_each_driver_refuses_what_it_cannot_carry_out() -> None:
    with pytest.raises(FaultError, match="action 'flip' is not carried out here"):
        load_scenario(None, ['faults=["flip:compute=forward"]'])
    with pytest.raises(FaultError, match=r"runtime.fault 'leave:t=3': action 'leave' is not carried out here"):
        runtime_fault("leave:t=3")
    assert runtime_fault("  ") is None
    assert fault_from("", {FAULT_ENV: "crash:after=step"}) == Fault(event="crash", after_event="step")
    assert fault_from("flip:compute=forward", {FAULT_ENV: "crash:after=step"}) == Fault(
        event="flip", after_compute="forward")
    assert set(ACTIONS) == {"crash", "leave", "join", "cut", "degrade", "crash_stage", "flip"}


def _rec(watch: FaultWatch, name: str, node: str, **fields: object) -> list[tuple[str, str]]:
    return [(x.fault.spec(), x.node) for x in watch.on_record(name, node, fields)]


def test_watch_counts_every_matching_point_and_fires_once_on_count() -> None:
    a = parse_fault("crash:after=step:count=3")  # any node: counts steps swarm-wide, hits the 3rd's node
    b = parse_fault("crash:after=step:node=n2:count=2")  # only n2's steps
    watch = FaultWatch([a, b])
    got = [_rec(watch, RecordName.STEP, n) for n in ("n1", "n2", "n3", "n2", "n2", "n1")]
    assert got == [[], [], [(a.spec(), "n3")], [(b.spec(), "n2")], [], []]
    assert [watch.seen(0), watch.seen(1)] == [3, 2]  # nothing counted once fired
    assert [x.fault for x in watch.fired] == [a, b]
    assert _rec(watch, RecordName.CONTRIBUTE, "n1") == []


def test_watch_filters_iteration_from_mb_and_stage() -> None:
    it2 = parse_fault("crash:after=contribute:iter=2")
    since = parse_fault("crash:after=contribute:from=2:count=2")
    mb1 = parse_fault("crash:after=contribute:mb=1:stage=2")
    watch = FaultWatch([it2, since, mb1])
    # a record's iteration / index come from its fields, else from its `mb` (dh, iteration, index)
    assert _rec(watch, "contribute", "r", mb=("d", 1, 1), stage=1) == []
    assert _rec(watch, "contribute", "r", stage=2) == []  # no iteration: from= and iter= cannot match
    assert _rec(watch, "contribute", "r", mb=("d", 3, 0), stage=2) == []  # since: 1st match
    assert _rec(watch, "contribute", "r", iteration=2, index=1, stage=2) == [
        (it2.spec(), "r"), (since.spec(), "r"), (mb1.spec(), "r")]


def test_watch_compute_triggers_and_the_aggregate_group() -> None:
    def job(kind: ComputeKind, it: int, stage: int = 1) -> Compute:
        return Compute(job_id=0, kind=kind, stage=stage, mb=None, flops=0.0, inputs=(("g", stage, it),))

    agg = parse_fault("crash:compute=aggregate:iter=2")
    fwd = parse_fault("crash:compute=forward:node=r1:count=2")
    watch = FaultWatch([agg, fwd])
    assert watch.on_record("step", "r1", {"iteration": 2}) == []  # a compute trigger ignores records
    assert watch.on_compute(job(ComputeKind.BACKWARD, 2), "r1") == []
    [x] = watch.on_compute(job(ComputeKind.REDUCE, 2), "r2")
    assert (x.fault, x.node, x.point, x.iteration, x.stage) == (agg, "r2", "reduce", 2, 1)
    mb = Compute(job_id=1, kind=ComputeKind.FORWARD, stage=1, mb=("d", 4, 1), flops=0.0)
    assert watch.on_compute(mb, "r2") == [] and watch.on_compute(mb, "r1") == []
    [y] = watch.on_compute(mb, "r1")
    assert (y.fault, y.node, y.iteration, y.mb) == (fwd, "r1", 4, 1)


def test_watch_time_triggers() -> None:
    late, early = parse_fault("crash:t=5:node=a"), parse_fault("join:t=1")
    watch = FaultWatch([late, early, parse_fault("crash:after=step")])
    assert watch.timed == (late, early)
    assert [x.fault for x in watch.due(0.5)] == []
    assert [x.fault for x in watch.due(1.0)] == [early]
    assert [(x.fault, x.node) for x in watch.due(9.0)] == [(late, "a")]
    assert watch.due(99.0) == []


def _small(faults: str) -> list[str]:
    return ['model.preset="tiny"', "model.seq_len=32", "model.microbatch_size=2", "model.stages=3",
            "nodes.count=8", "nodes.data_holders=2", "nodes.relay_capacity=[1, 3]", "train.iterations=2",
            "train.microbatches=2", "sim.max_time_s=1500.0", f"faults={faults}"]


def test_the_simulator_fires_a_compute_trigger_once_at_the_named_node() -> None:
    base, _ = run_scenario(load_scenario(None, _small("[]")), 3)
    assert base["counters"].get("crashes_injected", 0) == 0
    sc = load_scenario(None, _small('["crash:compute=backward:count=2"]'))
    summary, _ = run_scenario(sc, 3)
    assert summary["counters"]["crashes_injected"] == 1
    assert summary["invariant_violations"] == 0


def _gwtf(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GWTF_CACHE": str(tmp_path / "cache"), "GWTF_PIP_INDEX_URL": "none"}
    return subprocess.run([sys.executable, "-m", "gwtf", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path, check=False)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("simulate", str(SMOKE), "--fault", "kill:forward"), "--fault 'kill:forward': unknown action 'kill'"),
        (("simulate", str(SMOKE), "--fault", "flip:compute=forward"), "action 'flip' is not carried out here"),
        (("node", "--set", 'runtime.fault="crash:forward"'), "runtime.fault 'crash:forward': trigger 'forward'"),
        (("swarm", "--fault", "r1a=crash:compute=nope"), "after_compute 'nope' is not a compute kind"),
        (("swarm", "--fault", "zz=crash:t=1"), "--fault 'zz=crash:t=1': no initial node 'zz'"),
    ],
    ids=["simulate-old-kill", "simulate-flip", "node-bare-point", "swarm-bad-kind", "swarm-unknown-node"],
)
def test_the_cli_flags_refuse_a_bad_fault_with_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...],
                                                                    needle: str) -> None:
    proc = _gwtf(tmp_path, *args)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0], lines[0]


def test_simulate_fault_flag_adds_a_fault_and_the_resolved_scenario_keeps_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _gwtf(tmp_path, "simulate", str(SMOKE), "--no-progress", "--out", str(out), "--set", "train.iterations=2",
                 "--fault", "crash:t=5:node=n4")
    assert proc.returncode == 0, proc.stderr
    resolved = load_scenario(out / "scenario.resolved.toml").faults
    assert resolved == (Fault(event="crash", after_event="contribute", count=7), Fault(event="crash", time_s=5.0,
                                                                                      node="n4"))
    assert 'after_compute = ""' not in (out / "scenario.resolved.toml").read_text()  # only the keys set
