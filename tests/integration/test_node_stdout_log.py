"""What `gwtf node` leaves in its stdout.log, by hand and under `gwtf swarm` (issue 44 item 4).

- By hand (stdout a pipe, as a terminal or `| tee` would be): the node appends its output to
  `OUT/nodes/<name>/stdout.log` too; READY (listening) and SERVING (the first node serves
  stage 0 at once) come once in each.
- Under the launcher (stdout+stderr redirected into that very file): each line is written
  once, so every node's log has one READY line and one SERVING line, and the leader names every
  member that joined.
"""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TEST_CONFIG, Finish, MakeSwarm
from gwtf.runtime.launcher import parse_ready


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def _read_until(proc: subprocess.Popen[bytes], prefixes: set[str], timeout_s: float) -> list[str]:
    """Lines from the process's stdout pipe until one starting with each prefix came (bounded)."""
    assert proc.stdout is not None
    lines: list[str] = []
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while not all(any(line.startswith(p) for line in lines) for p in prefixes):
        left = deadline - time.monotonic()
        assert left > 0, "no " + " / ".join(sorted(prefixes)) + " in time:\n" + "\n".join(lines[-30:])
        if not sel.select(timeout=min(left, 1.0)):
            continue
        chunk = proc.stdout.read1(65536)  # type: ignore[attr-defined]
        assert chunk, f"node exited ({proc.poll()}) early:\n" + "\n".join(lines[-30:])
        buf += chunk
        *done, buf = buf.split(b"\n")
        lines += [d.decode("utf-8", "replace") for d in done]
    sel.close()
    return lines


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_node_by_hand_writes_its_own_stdout_log(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gwtf", "node", "--listen", "127.0.0.1:0", "--role", "data-holder", "--name",
           "dh0", "--config", TEST_CONFIG, "--out", str(out), "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        seen = _read_until(proc, {"READY ", "SERVING "}, timeout_s=90)
        proc.send_signal(signal.SIGTERM)  # a graceful leave
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0
    shown = seen + rest.decode("utf-8", "replace").splitlines()
    logged = _lines(out / "nodes" / "dh0" / "stdout.log")
    for lines in (shown, logged):
        ready = [line for line in lines if parse_ready(line) is not None]
        serving = [line for line in lines if line.startswith("SERVING ")]
        assert len(ready) == 1 and len(serving) == 1, "\n".join(lines)
        info = json.loads(serving[0][len("SERVING "):])
        assert (info["name"], info["role"], info["stage"], info["shard"]) == ("dh0", "data-holder", 0, 0)
    assert set(logged) <= set(shown)  # the log holds what the terminal showed (C-level output aside)
    assert any("leaving" in line for line in logged)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_under_the_launcher_every_node_logs_ready_and_serving_once(make_swarm: MakeSwarm, finish: Finish) -> None:
    swarm = make_swarm(("train.iterations=3",), replicas=1)
    swarm.start()
    finish(swarm, 3, 90)
    swarm.close()
    logs = {p.name: _lines(p.dir / "stdout.log") for p in swarm.group.procs}
    assert len(logs) >= 4, logs.keys()
    for name, lines in logs.items():
        assert sum(parse_ready(line) is not None for line in lines) == 1, f"{name}:\n" + "\n".join(lines)
        serving = [line for line in lines if line.startswith("SERVING ")]
        assert len(serving) == 1, f"{name}:\n" + "\n".join(lines)
        assert json.loads(serving[0][len("SERVING "):])["name"] == name
    leader = swarm.group.procs[0].name  # the bootstrap data holder: every other node joined it
    joined = {line.split("member ", 1)[1].split(" ", 1)[0] for line in logs[leader] if " joined; " in line}
    assert joined == set(logs) - {leader}, "\n".join(logs[leader])
