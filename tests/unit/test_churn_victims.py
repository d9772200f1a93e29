"""Whom `--churn` may kill (issue 42): any live, active node that served, a relay, a data holder
or the leader alike, as long as its stage keeps another live, active node (another replica of a
relay stage, another data holder for stage 0); `--churn-spare leader|data-holders` spares some;
`gwtf demo` scripts its first kill to be a data holder's. Fake processes (as in
test_swarm_crashes.py): no node process is started."""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_swarm_crashes import CONFIG, _end, _iteration, _node, _write

from gwtf.commands import swarm as swarm_cmd
from gwtf.commands.demo import DEMO_CHURN_ROLES
from gwtf.config import load_config
from gwtf.runtime import launcher
from gwtf.runtime import swarm as runtime_swarm
from gwtf.runtime.launcher import NodePlan, NodeProcess
from gwtf.runtime.status import STATUS_FILE, write_status
from gwtf.runtime.swarm import Swarm, SwarmOptions

NODES = ("dh0", "dh1", "r1a", "r1b", "r2a", "r2b")


def _swarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **opts: object) -> Swarm:
    cfg = load_config(str(CONFIG), ["model.stages=3"])
    swarm = Swarm(cfg, SwarmOptions(out_dir=tmp_path / "swarm", **opts), say=lambda s: None)  # type: ignore[arg-type]
    for name in NODES:
        role = "data-holder" if name.startswith("dh") else "relay"
        _node(swarm, name, role, 0 if role == "data-holder" else int(name[1]))

    def kill(p: NodeProcess) -> None:  # ProcessGroup.kill, faked
        _end(p, -signal.SIGKILL)
        p.state = "killed"

    monkeypatch.setattr(swarm.group, "kill", kill)
    monkeypatch.setattr(launcher, "_signal_group", lambda popen, sig: setattr(popen, "returncode", -sig))
    return swarm


@pytest.fixture
def swarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Swarm]:
    s = _swarm(tmp_path, monkeypatch)
    yield s
    s.close()


def _proc(swarm: Swarm, name: str) -> NodeProcess:
    return next(p for p in swarm.group.procs if p.name == name)


def _lead(swarm: Swarm, name: str, term: int) -> None:
    """`name` logs that it leads `term` (only the leader of a term logs `leader_term`)."""
    _write(_proc(swarm, name), {"event": "leader_term", "node": name, "term": term})
    swarm.metrics.poll(swarm.group.procs)


def _names(procs: list[NodeProcess]) -> list[str]:
    return [p.name for p in procs]


def _status(proc: NodeProcess, stage: int, state: str = "active", microbatches: int = 3) -> None:
    write_status(proc.dir / STATUS_FILE, {"name": proc.name, "role": proc.plan.role, "stage": stage,
                                          "state": state, "microbatches": microbatches})


def _joiner(swarm: Swarm, name: str, stage: int, state: str = "active", microbatches: int = 3) -> NodeProcess:
    """A joiner (planned as a relay, `--stage auto`) the leader sent to `stage` (0: a data holder)."""
    proc = _node(swarm, name, "relay", stage)
    proc.ready = {"node": name, "host": "127.0.0.1", "port": 1, "stage": -1}  # its stage came later
    _status(proc, stage, state, microbatches)
    return proc


def test_data_holders_and_the_leader_are_victims_like_relays(swarm: Swarm) -> None:
    _lead(swarm, "dh0", 0)
    assert swarm.metrics.leader() == "dh0"
    assert _names(swarm.churn_victims()) == sorted(NODES)
    assert _names(swarm.churn_victims("data-holder")) == ["dh0", "dh1"]
    assert _names(swarm.churn_victims("relay")) == ["r1a", "r1b", "r2a", "r2b"]
    with pytest.raises(ValueError, match="unknown churn role"):
        swarm.churn_victims("leader")


def test_each_eligible_node_is_as_likely_a_victim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded rng picks among the eligible nodes uniformly: over 600 seeds every one of the six
    is killed about 100 times (the leader and the other data holder too)."""
    swarm = _swarm(tmp_path, monkeypatch)
    _lead(swarm, "dh0", 0)
    eligible = swarm.churn_victims()
    counts = dict.fromkeys(NODES, 0)
    for seed in range(600):
        swarm.rng.seed(seed)
        counts[swarm.rng.choice(eligible).name] += 1
    assert all(60 <= n <= 140 for n in counts.values()), counts
    swarm.rng.seed(1)
    victim = swarm.kill_random_node("data-holder")
    assert victim is not None and victim.name in ("dh0", "dh1") and not victim.alive()
    assert swarm.crashes == 1 and swarm.churn_killed == [(victim.name, 0)] and swarm.holders_killed == [victim.name]
    swarm.close()


def test_spare_data_holders_or_the_leader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    holders = _swarm(tmp_path / "a", monkeypatch, churn_spare="data-holders")
    leader = _swarm(tmp_path / "b", monkeypatch, churn_spare="leader")
    try:
        for s in (holders, leader):
            _lead(s, "dh0", 0)
        assert _names(holders.churn_victims()) == ["r1a", "r1b", "r2a", "r2b"]
        assert holders.churn_victims("data-holder") == []
        assert _names(leader.churn_victims()) == ["dh1", "r1a", "r1b", "r2a", "r2b"]
        _lead(leader, "dh1", 1)  # an election: dh1 leads term 1 now (dh0 lives on, a follower)
        assert _names(leader.churn_victims("data-holder")) == ["dh0"]
        # the leader died and no successor logged its term yet: no data holder is killed meanwhile
        _lead(leader, "dh0", 2)
        _end(_proc(leader, "dh0"), -signal.SIGKILL)
        _joiner(leader, "j1", 0)
        assert leader.churn_victims("data-holder") == []
        assert _names(leader.churn_victims()) == ["r1a", "r1b", "r2a", "r2b"]
    finally:
        holders.close()
        leader.close()


def test_the_last_replica_of_a_stage_is_never_a_victim(swarm: Swarm) -> None:
    _end(_proc(swarm, "r2b"), -signal.SIGKILL)  # stage 2 is down to r2a
    _status(_proc(swarm, "r1b"), 1, microbatches=0)  # it has not served yet: r1b is no victim, r1a is
    assert _names(swarm.churn_victims()) == ["dh0", "dh1", "r1a"]
    j = _joiner(swarm, "j1", 2, state="joining")  # a joiner not active yet does not count for stage 2
    assert "r2a" not in _names(swarm.churn_victims())
    _status(j, 2, microbatches=0)  # active now: r2a may die (j1 has not served: it is no victim itself)
    assert _names(swarm.churn_victims()) == ["dh0", "dh1", "r1a", "r2a"]


def test_the_last_data_holder_is_never_a_victim(swarm: Swarm) -> None:
    """Stage 0 keeps at least one live, active data holder: killing the last would pause training.
    A joiner the leader made a data holder (stage 0) counts once active, and is a victim once it
    served."""
    _lead(swarm, "dh0", 0)
    _end(_proc(swarm, "dh1"), -signal.SIGKILL)
    assert swarm.churn_victims("data-holder") == []
    assert "dh0" not in _names(swarm.churn_victims())  # the leader, the last data holder
    j = _joiner(swarm, "j1", 0, state="joining")  # taking dh1's vacant shard, not active yet
    assert swarm.churn_victims("data-holder") == []
    _status(j, 0, microbatches=0)  # active: dh0 may die now, not j1 (it has trained nothing yet)
    assert _names(swarm.churn_victims("data-holder")) == ["dh0"]
    _status(j, 0)
    assert _names(swarm.churn_victims("data-holder")) == ["dh0", "j1"]
    _end(_proc(swarm, "dh0"), -signal.SIGKILL)
    assert swarm.churn_victims("data-holder") == []  # j1 is the last data holder now


def test_a_scripted_data_holder_kill_waits_for_an_eligible_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gwtf demo`'s churn (`churn_roles=("data-holder",)`): its first kill is a data holder's; while
    none may die (the other data holder is gone) no relay dies instead: the kill waits. The
    joiner started after it is announced once it steps as a data holder, and `done:` says so."""
    said: list[str] = []
    swarm = _swarm(tmp_path, monkeypatch, churn="high", churn_roles=DEMO_CHURN_ROLES)
    swarm.say = said.append
    started: list[str] = []

    def join_node(stage: str = "auto") -> NodeProcess:  # Swarm.join_node, faked: no process
        name = f"j{len(swarm.joiners) + 1}"
        swarm.joiners.append(name)
        started.append(name)
        return NodeProcess(plan=NodePlan(name=name, role="relay", stage=stage), popen=None,  # type: ignore[arg-type]
                           dir=tmp_path, started_s=0.0)

    monkeypatch.setattr(swarm, "join_node", join_node)
    swarm._pending_kills = [1, 2]
    try:
        _lead(swarm, "dh0", 0)
        _end(_proc(swarm, "dh1"), -signal.SIGKILL)
        dh0 = _proc(swarm, "dh0")
        for it in (0, 1):
            _iteration(dh0, it)
        _steps(swarm, lambda: False, 0.5)  # several kill moments pass (each a fraction of an iteration)
        assert swarm.metrics.next_iteration == 2
        assert swarm.churn_killed == [] and started == [] and swarm._pending_kills == [1, 2]
        j1 = _joiner(swarm, "j1", 0)  # dh1's shard has a new holder: dh0 may die now
        swarm.joiners.append("j1")
        _iteration(j1, 2)
        _iteration(dh0, 2)
        _steps(swarm, lambda: bool(swarm.churn_killed), 5.0)
        assert swarm.churn_killed[0] in (("dh0", 0), ("j1", 0)), swarm.churn_killed
        assert swarm.holders_replaced == ["j1"]
        assert "churn: joiner j1 replaced a data holder (from iteration 2)" in said
        killed = swarm.churn_killed[0][0]
        assert f"churn: kill -9 {killed} (data holder{', the leader' if killed == 'dh0' else ''})" in said
        assert swarm_cmd.holders_text(swarm).startswith(f", data holders killed {len(swarm.holders_killed)} (")
    finally:
        swarm.close()


def _steps(swarm: Swarm, until: Callable[[], bool], timeout_s: float) -> None:
    """Poll the swarm (records, churn) until `until()` or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        swarm.step()
        time.sleep(0.02)  # polling period of a bounded wait


def test_the_spare_choices_are_the_runtimes() -> None:
    assert swarm_cmd.CHURN_SPARE == runtime_swarm.CHURN_SPARE
    parser = argparse.ArgumentParser()
    swarm_cmd.add_arguments(parser)
    assert parser.parse_args(["--churn-spare", "data-holders"]).churn_spare == "data-holders"
    assert parser.parse_args([]).churn_spare == "none"
