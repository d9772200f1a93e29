"""A fault its node's role can never fire is refused (issue 42): a compute kind only the other
role runs (`kinds.STAGE0_KINDS`: data holders; `kinds.RELAY_KINDS`: relays; every other kind
runs at any stage), or a `stage` filter no compute job of that role carries. `gwtf swarm
--fault` and a fault every initial swarm node inherits, `gwtf node --role data-holder` or
`--role relay --stage K`, and a scenario fault naming an initial data holder refuse it with one
line and exit 2 (`faults.check_role`). Nodes whose role may change are not checked: a relay with
`--stage auto` (a joiner) or a simulated relay may be made a data holder (a vacant shard). The
two sets are checked against the protocol itself: in a simulated run with churn a stage-0 node
never runs a relay's kind, nor a relay-stage node a data holder's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_errors import assert_one_line_error, assert_one_line_error_in_process, gwtf, gwtf_in_process
from gwtf.commands.node import _check_fault_role
from gwtf.commands.swarm import parse_node_faults
from gwtf.config import Config, load_config
from gwtf.protocol.faults import FaultError, FaultWatch, check_role, parse_fault
from gwtf.protocol.kinds import RELAY_KINDS, STAGE0_KINDS, ComputeKind
from gwtf.protocol.messages import Compute
from gwtf.runtime.swarm import SwarmOptions
from gwtf.sim.scenario import load_scenario
from gwtf.sim.simulator import run_scenario

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "swarm-demo.toml")
SMOKE = str(ROOT / "configs" / "scenarios" / "smoke.toml")


def test_each_kind_fires_on_the_roles_that_run_it() -> None:
    assert not STAGE0_KINDS & RELAY_KINDS
    for kind in [*ComputeKind, "aggregate", "any"]:
        for role, never in (("data-holder", RELAY_KINDS), ("relay", STAGE0_KINDS)):
            fault = parse_fault(f"crash:compute={kind}")
            if kind in never:
                with pytest.raises(FaultError, match=rf"^here: a {role.replace('-', ' ')} .*never runs "
                                                     rf"compute kind '{kind}'.*never fire"):
                    check_role(fault, role, "here")
            else:
                check_role(fault, role, "here")


def test_a_stage_filter_no_compute_job_of_the_role_carries() -> None:
    check_role(parse_fault("crash:compute=aggregate:stage=0"), "data-holder", "here", stages=3)
    check_role(parse_fault("crash:compute=backward:stage=2"), "relay", "here", stages=3)
    check_role(parse_fault("crash:after=checkpoint_stored:stage=2"), "data-holder", "here", stages=3)  # a record
    check_role(parse_fault("crash_stage:compute=step:stage=2"), "data-holder", "here", stages=3)  # the target
    for spec, role, why in (("crash:compute=step:stage=1", "data-holder", "its jobs are at stage 0"),
                            ("crash:compute=step:stage=0", "relay", "its jobs are at stages 1..2"),
                            ("crash:compute=forward:stage=3", "relay", "its jobs are at stages 1..2")):
        with pytest.raises(FaultError, match=f"^here: stage=.*{why}, so this fault would never fire$"):
            check_role(parse_fault(spec), role, "here", stages=3)


def test_gwtf_swarm_fault_on_the_wrong_role_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = gwtf(tmp_path, "swarm", "--config", DEMO, "--data-holders", "3", "--iterations", "2", "--out",
                str(tmp_path / "run"), "--fault", "dh0=crash:compute=embed", "--fault", "dh1=crash:compute=forward")
    assert_one_line_error(proc, "--fault 'dh1=crash:compute=forward' (node dh1)", "a data holder",
                          "compute kind 'forward'", "never fire")
    assert not (tmp_path / "run").exists()  # refused before anything starts


@pytest.mark.parametrize(("args", "needles"), [
    (("swarm", "--fault", "r1b=crash:compute=embed:from=2"),
     ("--fault 'r1b=crash:compute=embed:from=2' (node r1b)", "a relay", "compute kind 'embed'")),
    (("swarm", "--fault", "r2a=crash:compute=loss"), ("(node r2a)", "a relay", "'loss'")),
    (("swarm", "--fault", "dh0=crash:compute=backward:iter=2"), ("(node dh0)", "a data holder", "'backward'")),
    (("swarm", "--fault", "dh0=crash:compute=step:stage=1"), ("stage=1", "a data holder", "at stage 0")),
    (("swarm", "--set", 'runtime.fault="crash:compute=embed"'),
     ("runtime.fault 'crash:compute=embed' (every node without its own --fault, here r1a)", "a relay")),
    (("node", "--role", "relay", "--stage", "2", "--set", 'runtime.fault="crash:compute=embed_backward"'),
     ("runtime.fault 'crash:compute=embed_backward' (--role relay --stage 2)", "a relay", "'embed_backward'")),
    (("node", "--role", "data-holder", "--set", 'runtime.fault="flip:compute=forward:from=2"'),
     ("(--role data-holder)", "a data holder", "'forward'")),
    (("simulate", SMOKE, "--fault", "crash:compute=forward:node=n0"),
     ("scenario: faults 'crash:compute=forward:node=n0' (node n0)", "a data holder")),
    (("simulate", SMOKE, "--fault", "crash:compute=export_checkpoint:node=n2"), ("(node n2)", "'export_checkpoint'")),
], ids=["swarm-relay-embed", "swarm-relay-loss", "swarm-dh-backward", "swarm-dh-stage", "swarm-shared",
        "node-relay", "node-dh", "simulate-dh", "simulate-dh-checkpoint"])
def test_each_driver_refuses_a_fault_its_role_never_fires(tmp_path: Path, args: tuple[str, ...],
                                                         needles: tuple[str, ...]) -> None:
    out = ("--out", str(tmp_path / "run"))
    config = out if args[0] == "simulate" else ("--config", DEMO, *out)
    assert_one_line_error_in_process(gwtf_in_process(tmp_path, *args[:1], *config, *args[1:]), *needles,
                                     "so this fault would never fire")
    assert not (tmp_path / "run").exists()


def test_faults_the_roles_can_fire_are_kept(tmp_path: Path) -> None:
    cfg: Config = load_config(DEMO, ["train.data_holders=2"])
    opts = SwarmOptions(out_dir=tmp_path)
    specs = ["dh0=crash:compute=embed:from=8", "dh1=crash:compute=aggregate:stage=0", "r1a=crash:compute=forward",
             "r1b=crash:compute=export_state:from=6", "r2a=crash:after=loss", "r2b=crash:compute=step:stage=1"]
    assert parse_node_faults(specs, cfg, opts) == dict(s.split("=", 1) for s in specs)
    # smoke: n0..n2 hold data, n3.. are relays; a relay, a joiner and "any node" are not checked
    # (the leader may make a relay or a joiner a data holder on a vacant shard)
    sc = load_scenario(SMOKE, ['faults=["crash:compute=loss:node=n2", "crash:compute=backward:node=n3", '
                               '"crash:compute=embed:node=n7", "crash:compute=forward:node=j1", '
                               '"crash:compute=embed"]'])
    assert len(sc.faults) == 5
    # the same for `gwtf node --role relay --stage auto`: checked only with --stage K (K >= 1)
    relay_embed: Config = load_config(DEMO, ['runtime.fault="crash:compute=embed"'])
    _check_fault_role(relay_embed, "relay", None)
    with pytest.raises(FaultError, match="--role relay --stage 1"):
        _check_fault_role(relay_embed, "relay", 1)


def test_the_protocol_never_asks_a_role_for_the_other_roles_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[tuple[str, int, str]] = set()  # (node, stage, kind) of every compute the cores issued
    original = FaultWatch.on_compute

    def on_compute(self: FaultWatch, job: Compute, node: str) -> Any:
        seen.add((node, job.stage, str(job.kind)))
        return original(self, job, node)

    monkeypatch.setattr(FaultWatch, "on_compute", on_compute)
    # churn (crashes, joins that fetch state) and a checkpoint every iteration (copies kept on the
    # data holders); a compute fault that never fires makes the simulator feed every compute
    sc = load_scenario(SMOKE, ["train.iterations=6", "protocol.checkpoint_every=1", "churn.join_rate_per_hour=600.0",
                               'faults=["crash:compute=any:count=1000000"]'])
    summary, _ = run_scenario(sc, 1)
    dhs = {f"n{k}" for k in range(sc.nodes.data_holders)}
    for node, stage, kind in seen:
        assert (stage == 0) == (node in dhs), (node, stage, kind)  # a compute job's stage is its node's
        assert kind not in (RELAY_KINDS if stage == 0 else STAGE0_KINDS), (node, stage, kind)
    kinds = {kind for _, _, kind in seen}
    assert {"embed", "loss", "embed_backward", "forward", "backward", "step", "store_checkpoint",
            "export_checkpoint"} <= kinds, (kinds, summary["counters"])
