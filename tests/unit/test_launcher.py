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
    cmd = group.command(NodePlan(name="dh0", role="data-holder", stage="0", shard=1, fault="crash:compute=forward"), "h:1")
    group.close()
    assert cmd[1:4] == ["-m", "gwtf", "node"]
    text = " ".join(cmd)
    for part in ("--name dh0", "--role data-holder", "--stage 0", "--shard 1", "--join h:1", "--config c.toml",
                 "--set train.iterations=3", '--set runtime.fault="crash:compute=forward"'):
        assert part in text


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


def test_wan_model_delays_by_latency_plus_serialised_bytes() -> None:
    """The simulator's delay model on this node's uplink: bulk messages queue behind each other
    (to any peer), a control message waits for none; the header is CONTROL_BYTES."""
    from gwtf.flow.network import CONTROL_BYTES, load_network
    from gwtf.runtime.clock import WanModel
    from gwtf.sim.models import NetworkModel

    net = load_network("geo10")
    wan = WanModel(net)
    lat, bw = net.latency_s("Oregon", "Tokyo"), net.bandwidth_bytes_per_s("Oregon", "Tokyo")
    first = wan.deliver_at(100.0, "Oregon", "Tokyo", 1_000_000)
    assert first == pytest.approx(100.0 + (1_000_000 + CONTROL_BYTES) / bw + lat)
    second = wan.deliver_at(100.0, "Oregon", "Tokyo", 1_000_000)  # queued behind the first on the uplink
    assert second == pytest.approx(100.0 + 2 * (1_000_000 + CONTROL_BYTES) / bw + lat)
    control = wan.deliver_at(100.0, "Oregon", "Tokyo", 0)
    assert control == pytest.approx(100.0 + CONTROL_BYTES / bw + lat)
    assert wan.deliver_at(5.0, "Mars", "Tokyo", 10) == 5.0
    with pytest.raises(ValueError, match="Mars"):
        wan.check_region("Mars")
    # the simulator's model gives the same times for the same sends
    sim = NetworkModel(net, CONTROL_BYTES)
    sim.add_node("a", "Oregon")
    sim.add_node("b", "Tokyo")
    got = [sim.send("a", "b", n, 100.0)[1] for n in (1_000_000, 1_000_000, 0)]
    assert got == pytest.approx([first, second, control])


def test_timers_replace_and_outbox_keeps_per_peer_order_and_reports_failures() -> None:
    import asyncio

    from gwtf.runtime.clock import Outbox, TimerTable

    async def scenario() -> tuple[list[object], list[tuple[str, object]], list[tuple[str, object]]]:
        loop = asyncio.get_running_loop()
        fired: list[object] = []
        done = loop.create_future()
        timers = TimerTable(loop, lambda key: (fired.append(key), done.set_result(None) if key == "end" else None))
        now = loop.time()
        timers.set("a", now + 0.05)
        timers.set("a", now + 0.01)  # replaces
        timers.set("b", now + 0.02)
        timers.cancel("b")
        timers.set("end", now + 0.03)
        sent: list[tuple[str, object]] = []
        failed: list[tuple[str, object]] = []

        async def send(addr: str, msg: object, tensors: list[object]) -> None:
            if addr == "dead":
                raise ConnectionError("refused")
            await asyncio.sleep(0.001 if msg == 1 else 0)
            sent.append((addr, msg))

        box = Outbox(send, lambda addr, msg, exc: failed.append((addr, msg)), loop)
        for i in range(5):
            box.put("p", i, [], deliver_at=now + (0.02 if i == 0 else 0.0))
        box.put("dead", "x", [])
        async with asyncio.timeout(5):
            await done
            await box.flush(timeout_s=5)
        await box.close()
        return fired, sent, failed

    fired, sent, failed = asyncio.run(scenario())
    assert fired == ["a", "end"]
    assert sent == [("p", i) for i in range(5)], "a held-back first message must not be overtaken"
    assert failed == [("dead", "x")]


def test_render_table_shows_every_node_and_state() -> None:
    from rich.console import Console

    from gwtf.runtime.status import render_table

    console = Console(record=True, width=160)
    console.print(render_table([
        {"name": "dh0", "role": "data-holder", "stage": 0, "region": "local", "state": "active", "iteration": 3,
         "in_flight": 2, "last_loss": 4.25, "tokens_per_s": 1234.5, "iteration_s": 0.125, "microbatches": 31},
        {"name": "r1a", "role": "relay", "stage": None, "state": "crashed"},
    ], "swarm"))
    text = console.export_text()
    for part in ("dh0", "data-holder", "4.2500", "1234", "0.12", "31", "r1a", "crashed"):
        assert part in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stage", "9"], "--stage 9 is outside 0..2"),
        (["--set", 'runtime.fault="explode"'], "runtime.fault 'explode'"),
        (["--wan", "geo10", "--region", "Atlantis"], "--region 'Atlantis' is not in network geo10"),
        (["--join", "127.0.0.1:1"], "cannot reach join contact 127.0.0.1:1"),
    ],
)
def test_node_command_user_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    import subprocess

    config = Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml"
    proc = subprocess.run(
        [sys.executable, "-m", "gwtf", "node", "--out", str(tmp_path), "--config", str(config), *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "GWTF_SWARM_SECRET": "0123456789abcdef" * 2},
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gwtf: error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_ledger_audit_flags_double_counting_missing_work_and_divergence() -> None:
    from gwtf.runtime.audit import audit_ledger

    def decision(stage: int, contributions: dict[str, list[list[object]]]) -> dict[str, object]:
        return {"event": "decision", "iteration": 0, "round": 1, "stage": stage, "contributions": contributions,
                "expected": [["dh0", [0, 1]]]}

    def contribute(node: str, stage: int, idx: int, origin: str = "dh0") -> dict[str, object]:
        return {"event": "contribute", "node": node, "stage": stage, "mb": [origin, 0, idx]}

    good = {
        "dh0": [decision(0, {"dh0": [["dh0", 0], ["dh0", 1]]}), decision(1, {"r1a": [["dh0", 0]], "r1b": [["dh0", 1]]}),
                contribute("dh0", 0, 0), contribute("dh0", 0, 1)],
        "r1a": [contribute("r1a", 1, 0)],
        "r1b": [contribute("r1b", 1, 1)],
    }
    hashes = {(0, 0): {"dh0": "h0"}, (0, 1): {"r1a": "h1", "r1b": "h1"}}
    assert audit_ledger(good, 1, 2, hashes, microbatches=2) == ([], {"expected": 4, "dropped": 0})

    twice = {**good, "dh0": [good["dh0"][0], decision(1, {"r1a": [["dh0", 0], ["dh0", 1]], "r1b": [["dh0", 1]]}),
                             *good["dh0"][2:]]}
    problems, _ = audit_ledger(twice, 1, 2, hashes, microbatches=2)
    assert any("counted twice [('dh0', 1)]" in p for p in problems)
    assert any("r1a credited with unlogged" in p for p in problems)

    missing = {**good, "dh0": [good["dh0"][0], decision(1, {"r1a": [["dh0", 0]]}), *good["dh0"][2:]]}
    assert any("missing [('dh0', 1)]" in p for p in audit_ledger(missing, 1, 2, hashes)[0])

    diverged = {**hashes, (0, 1): {"r1a": "h1", "r1b": "other"}}
    assert any("replicas diverged" in p for p in audit_ledger(good, 1, 2, diverged)[0])

    # a crashed data holder's microbatch may stay counted once at a relay, and is dropped
    lost = {**good, "dh0": [*good["dh0"][:1], decision(1, {"r1a": [["dh0", 0], ["dh1", 0]], "r1b": [["dh0", 1]]}),
                            *good["dh0"][2:], {"event": "dh_lost", "node": "dh1", "iteration": 0, "started": -1}],
            "r1a": [contribute("r1a", 1, 0), contribute("r1a", 1, 0, origin="dh1")]}
    assert audit_ledger(lost, 1, 2, hashes, microbatches=2) == ([], {"expected": 4, "dropped": 2})


def test_audit_voids_steps_a_rollback_ran_again_and_replays_the_invariant_checker() -> None:
    """A stage lost at iteration 8 rolls the swarm back to version 5: iterations 5-7 run again
    with other replicas (other summation groups), so the steps logged before the rollback no
    longer stand; two leaders of one term fail the replayed simulator checker."""
    from gwtf.runtime.audit import current_step_hashes, replay_invariants

    def stepped(it: int, h: str, at: float) -> dict[str, object]:
        return {"event": "stepped", "iteration": it, "stage": 2, "hash": h, "unix_s": at}

    records = {
        "r2a": [stepped(5, "old5", 1.0), stepped(6, "old6", 2.0)],
        "dh0": [{"event": "rollback", "version": 5, "lost_from": 8, "lost_iterations": 3, "unix_s": 3.0}],
        "j1": [stepped(4, "keep4", 0.5), stepped(5, "new5", 4.0), stepped(6, "new6", 5.0)],
    }
    standing = current_step_hashes(records)
    assert standing[(5, 2)] == {"j1": "new5"} and standing[(6, 2)] == {"j1": "new6"}
    assert standing[(4, 2)] == {"j1": "keep4"}
    two = {"a": [{"event": "leader_term", "node": "a", "term": 1, "unix_s": 1.0}],
           "b": [{"event": "leader_term", "node": "b", "term": 1, "unix_s": 2.0}]}
    assert any("two_leaders" in v for v in replay_invariants(two, 3))
