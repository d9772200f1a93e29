"""The process launcher with stand-in node programs: READY handshake, deadlines, always-kill.

The stand-ins are tiny Python programs (not gwtf nodes) so these tests exercise the real process
handling (sessions, signals, files) in about a second. The fault-spec parser and the status
files are tested here too: they are the launcher's and the chaos tests' plumbing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gwtf.errors import UserError
from gwtf.runtime.chaos import FaultSpec, parse_fault
from gwtf.runtime.launcher import NodePlan, NodeStartError, ProcessGroup, parse_ready
from gwtf.runtime.status import JsonlTail, RecordLog, read_status, write_status


class FakeGroup(ProcessGroup):
    """Runs `script` (Python source) instead of `gwtf node`; the node name is argv[1]."""

    def __init__(self, out_dir: Path, script: str) -> None:
        super().__init__(out_dir)
        self.script = textwrap.dedent(script)

    def command(self, plan: NodePlan, join: str | None, listen: str = "127.0.0.1:0") -> list[str]:
        return [sys.executable, "-c", self.script, plan.name, str(self.out_dir)]


READY_SCRIPT = """
    import json, os, subprocess, sys, time
    print("starting up", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(os.path.join(sys.argv[2], sys.argv[1] + ".child"), "w").write(str(child.pid))
    print("READY " + json.dumps({"node": sys.argv[1], "host": "127.0.0.1", "port": 4242, "stage": 1}), flush=True)
    time.sleep(60)
"""


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and ("Z" in line or "X" in line) for line in f)
    except FileNotFoundError:
        return True


def test_parse_ready_accepts_only_complete_ready_lines() -> None:
    assert parse_ready('READY {"node": "a", "host": "h", "port": 1}') == {"node": "a", "host": "h", "port": 1}
    assert parse_ready('READY {"node": "a"}') is None
    assert parse_ready("READY not json") is None
    assert parse_ready('hello {"node": "a", "host": "h", "port": 1}') is None


def test_ready_line_gives_address_and_close_kills_whole_process_group(tmp_path: Path) -> None:
    with FakeGroup(tmp_path, READY_SCRIPT) as group:
        procs = [group.spawn(NodePlan(name=f"n{i}")) for i in range(2)]
        group.wait_ready(procs, timeout_s=20)
        assert [p.addr for p in procs] == ["127.0.0.1:4242"] * 2
        assert procs[1].node_id == "n1"
        child_pids = [int((tmp_path / f"n{i}.child").read_text()) for i in range(2)]
        assert all(not _pid_gone(pid) for pid in child_pids)
    assert all(p.popen.returncode == -signal.SIGKILL for p in procs)
    deadline = time.monotonic() + 10  # SIGKILL delivery to the grandchildren is asynchronous
    while not all(_pid_gone(pid) for pid in child_pids) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling period of a bounded wait
    assert all(_pid_gone(pid) for pid in child_pids), "grandchildren survived the group kill"


def test_node_exiting_before_ready_raises_with_its_output(tmp_path: Path) -> None:
    with FakeGroup(tmp_path, "import sys; print('bad config: model.stages'); sys.exit(2)") as group:
        proc = group.spawn(NodePlan(name="x"))
        with pytest.raises(NodeStartError, match="exited with code 2 before READY:\nbad config"):
            group.wait_ready([proc], timeout_s=20)


def test_silent_node_hits_the_deadline_and_is_killed(tmp_path: Path) -> None:
    with FakeGroup(tmp_path, "import time; time.sleep(60)") as group:
        proc = group.spawn(NodePlan(name="quiet"))
        with pytest.raises(NodeStartError, match="no READY from quiet"):
            group.wait_ready([proc], timeout_s=0.3)
    assert proc.popen.returncode == -signal.SIGKILL


def test_kill_is_sigkill_and_stop_is_graceful_sigterm(tmp_path: Path) -> None:
    script = """
        import json, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        print("READY " + json.dumps({"node": sys.argv[1], "host": "127.0.0.1", "port": 1}), flush=True)
        time.sleep(60)
    """
    with FakeGroup(tmp_path, script) as group:
        a, b = group.spawn(NodePlan(name="a")), group.spawn(NodePlan(name="b"))
        group.wait_ready([a, b], timeout_s=20)
        group.kill(a)
        assert a.popen.returncode == -signal.SIGKILL and a.state == "killed"
        assert group.stop(b, timeout_s=20) == 0 and b.state == "stopped"
        assert group.live() == []
        with pytest.raises(ValueError, match="already used"):
            group.spawn(NodePlan(name="a"))


def test_command_line_carries_identity_flags_and_fault() -> None:
    group = ProcessGroup("/tmp/out", config_path="c.toml", overrides=["train.iterations=3"])
    cmd = group.command(NodePlan(name="dh0", role="data-holder", stage="0", shard=1, fault="kill:forward"), "h:1")
    group.close()
    assert cmd[1:4] == ["-m", "gwtf", "node"]
    text = " ".join(cmd)
    for part in ("--name dh0", "--role data-holder", "--stage 0", "--shard 1", "--join h:1", "--config c.toml",
                 "--set train.iterations=3", '--set runtime.fault="kill:forward"'):
        assert part in text


def test_fault_spec_grammar() -> None:
    spec = parse_fault("kill:forward:iter=2:mb=1")
    assert spec == FaultSpec(action="kill", point="forward", iteration=2, mb_index=1)
    assert not spec.matches("forward", 2, 0, 1)
    assert not spec.matches("backward", 2, 1, 1)
    assert spec.matches("forward", 2, 1, 1)
    after = parse_fault("kill:aggregate:after=1")
    assert after is not None
    assert [after.matches("step", 0, None, 1), after.matches("aggregate", 1, None, 1)] == [False, True]
    assert parse_fault("  ") is None
    for bad in ("forward", "kill:", "kill:forward:iter", "kill:forward:iter=x", "kill:forward:color=1"):
        with pytest.raises(UserError, match="runtime.fault"):
            parse_fault(bad)


def test_status_is_atomic_and_jsonl_tail_skips_torn_lines(tmp_path: Path) -> None:
    write_status(tmp_path / "status.json", {"state": "active", "stage": 2})
    assert read_status(tmp_path / "status.json") == {"state": "active", "stage": 2}
    assert read_status(tmp_path / "missing.json") is None
    log = RecordLog(tmp_path / "r.jsonl")
    tail = JsonlTail(tmp_path / "r.jsonl")
    log.write({"event": "a", "mb": ("dh0", 1, 2)})
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write('{"event": "torn"')  # a kill -9 mid-line
    assert tail.read_new() == [{"event": "a", "mb": ["dh0", 1, 2]}]
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write(', "x": 1}\nnot json\n')
    assert tail.read_new() == [{"event": "torn", "x": 1}]
    log.close()
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])["event"] == "a"
    assert os.path.getsize(tmp_path / "r.jsonl") > 0
