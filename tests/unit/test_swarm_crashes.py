"""A swarm counts every crash (issue 42): a node its scripted fault killed (it SIGKILLs itself
after its `fault` record), one that exited with an error, and `--churn`'s kill -9, each once;
exit 0 (training finished, a graceful leave) is no crash. The count reaches metrics.jsonl, the
progress lines (their `crashes` field) and `done:` (`Swarm.crashes`). Fake processes: no node
process is started."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from gwtf.config import Config, load_config
from gwtf.runtime import launcher
from gwtf.runtime.launcher import NodePlan, NodeProcess
from gwtf.runtime.status import RECORDS_FILE, STATUS_FILE, node_dir, write_status
from gwtf.runtime.swarm import Swarm, SwarmOptions, crashed, fault_fired

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml"


class _Popen:
    """A process whose exit the test decides (the swarm asks `poll()`, `returncode`, `wait()`)."""

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        assert self.returncode is not None, "the test ends every fake process itself"
        return self.returncode


def _node(swarm: Swarm, name: str, role: str, stage: int) -> NodeProcess:
    plan = NodePlan(name=name, role=role, stage=str(stage), shard=0 if role == "data-holder" else None)
    popen: Any = _Popen()
    proc = NodeProcess(plan=plan, popen=popen, dir=node_dir(swarm.opts.out_dir, name), started_s=0.0,
                       ready={"node": name, "host": "127.0.0.1", "port": 1, "stage": stage}, state="ready")
    write_status(proc.dir / STATUS_FILE, {"name": name, "role": role, "stage": stage, "state": "active",
                                          "microbatches": 3})
    swarm.group.procs.append(proc)
    return proc


def _write(proc: NodeProcess, *rows: dict[str, Any]) -> None:
    with (proc.dir / RECORDS_FILE).open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"unix_s": 1.0, **row}) + "\n")


def _iteration(proc: NodeProcess, it: int) -> None:
    _write(proc, {"event": "loss", "iteration": it, "index": 0, "loss": 4.0, "tokens": 32},
           {"event": "stepped", "iteration": it, "stage": 0, "hash": f"h{it}"})


def _end(proc: NodeProcess, code: int) -> None:
    proc.popen.returncode = code


def test_every_crash_is_counted_once_whatever_killed_the_node(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg: Config = load_config(str(CONFIG), ["model.stages=2"])
    said: list[str] = []
    swarm = Swarm(cfg, SwarmOptions(out_dir=tmp_path / "swarm"), say=said.append)
    dh0, dh1 = _node(swarm, "dh0", "data-holder", 0), _node(swarm, "dh1", "data-holder", 0)
    relays = [_node(swarm, n, "relay", 1) for n in ("r1a", "r1b", "r1c")]
    try:
        for dh in (dh0, dh1):
            _iteration(dh, 0)
        assert [r["crashes"] for r in swarm.step()] == [0]

        # dh1's scripted fault fires (crash:compute=embed:from=1): its record, then SIGKILL by itself
        _write(dh1, {"event": "fault", "point": "embed", "iteration": 1, "index": 0, "stage": 0, "action": "crash"})
        _end(dh1, -signal.SIGKILL)
        _end(relays[0], 3)  # r1a gave up (evicted): exit 3
        _iteration(dh0, 1)
        assert [r["crashes"] for r in swarm.step()] == [2]
        assert swarm.crashes == 2
        assert "node dh1 crashed: its scripted fault fired (at embed, iteration 1, microbatch 0)" in said
        assert "node r1a exited with code 3: no reason recorded" in said

        # --churn's kill -9 (ProcessGroup.kill, faked): counted where it is sent, not again when seen dead
        def kill(p: NodeProcess) -> None:
            _end(p, -signal.SIGKILL)
            p.state = "killed"

        monkeypatch.setattr(swarm.group, "kill", kill)
        victim = swarm.kill_random_node()
        assert victim is not None and victim.name in ("r1b", "r1c") and swarm.crashes == 3
        survivor = next(p for p in relays[1:] if p is not victim)
        _end(survivor, 0)  # training finished: no crash
        _iteration(dh0, 2)
        assert [r["crashes"] for r in swarm.step()] == [3]
        assert [r["crashes"] for r in swarm.step()] == [] and swarm.crashes == 3  # each node counted once
        late = _node(swarm, "dh9", "data-holder", 0)  # still running at close()
    finally:
        # close()'s SIGKILL of what still runs, faked (the fakes have no process to signal)
        monkeypatch.setattr(launcher, "_signal_group", lambda popen, sig: setattr(popen, "returncode", -sig))
        swarm.close()
    assert late.popen.poll() == -signal.SIGKILL
    assert swarm.step() == [] and swarm.crashes == 3  # a step after close() counts none of its kills
    rows = [json.loads(line) for line in (tmp_path / "swarm" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["crashes"], r["joins"]) for r in rows] == [(0, 0, 0), (1, 2, 0), (2, 3, 0)]
    assert swarm.crashes == 3  # close()'s kills are not crashes: `done:` says 3


@pytest.mark.parametrize(("code", "crash"), [(-signal.SIGKILL, True), (-signal.SIGTERM, True), (1, True),
                                             (4, True), (0, False)])
def test_a_crash_is_any_signal_or_non_zero_exit(code: int, crash: bool) -> None:
    assert crashed(code) is crash


def test_the_fault_record_of_a_crash() -> None:
    flip = {"event": "fault", "action": "flip", "point": "forward"}
    crash = {"event": "fault", "action": "crash", "point": "embed"}
    assert fault_fired([{"event": "step"}, flip]) is None
    assert fault_fired([flip, crash, {"event": "step"}]) == crash
