"""`gwtf demo` as a person watches it: under a pseudo-terminal (so the live table is drawn), the
swarm-wide header appears and the table's tokens/s and served columns fill in; Ctrl+C then ends
it with every node killed, loss.png written and each node's status.json saying it is dead.

One demo (2 data holders, stages 1 and 2 with 2 replicas each) on configs/swarm-test.toml, no
churn, loopback only. Every wait is bounded; the demo's process group is killed at the end
whatever happens.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import psutil
import pytest

from gwtf.runtime.status import read_status

ROOT = Path(__file__).resolve().parents[2]
TEST_CONFIG = str(ROOT / "configs" / "swarm-test.toml")
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-B]|\r")
HEADER = re.compile(r"iteration (\d+)/(\d+) \| ETA \S+ \| loss \S+ \| (\S+) tokens/s \| members by stage (.+?) \| "
                    r"crashes (\d+) \| joins (\d+)")
DEADLINE_S = 300.0


def _filled_frame(text: str) -> dict[str, dict[str, str]] | None:
    """The rows of the last drawn table whose tokens/s and served are filled (> 0), if that table has
    the header above it and a filled row for every stage and for both data holders."""
    if not HEADER.search(text):
        return None
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if "┃" in line and "served" in line and "tokens/s" in line]
    if not heads:
        return None
    columns = [c.strip() for c in lines[heads[-1]].split("┃")]
    filled: dict[str, dict[str, str]] = {}
    for line in lines[heads[-1] + 1:]:
        cells = [c.strip() for c in line.split("│")]
        if len(cells) != len(columns):
            continue
        row = dict(zip(columns, cells, strict=True))
        # tokens/s is the node's last iteration: 0 for a replica the routes left idle in it (loop run 1
        # at 1c4d68e drew such a frame), so a stage counts as filled by a row with both above 0
        if row["served"].isdigit() and int(row["served"]) > 0 and row["tokens/s"].isdigit() \
                and int(row["tokens/s"]) > 0:
            filled[row["node"]] = row
    stages = {row["stage"] for row in filled.values()}
    return filled if {"dh0", "dh1"} <= filled.keys() and {"0", "1", "2"} <= stages else None


@pytest.mark.integration
@pytest.mark.slow
def test_demo_under_a_terminal_shows_the_header_and_fills_the_table(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 220, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "220", "LINES": "60"}
    env.pop("NO_COLOR", None)
    cmd = [sys.executable, "-m", "gwtf", "demo", "--out", str(out), "--config", TEST_CONFIG,
           "--iterations", "100000", "--churn", "none", "--timeout-s", str(DEADLINE_S)]
    demo = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + DEADLINE_S
        filled = None
        while filled is None:
            assert time.monotonic() < deadline, ANSI.sub(b"", seen)[-4000:].decode(errors="replace")
            assert demo.poll() is None, ANSI.sub(b"", seen)[-4000:].decode(errors="replace")
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:  # the terminal closed
                    break
                filled = _filled_frame(ANSI.sub(b"", seen).decode(errors="replace"))
        assert filled is not None, ANSI.sub(b"", seen)[-4000:].decode(errors="replace")
        text = ANSI.sub(b"", seen).decode(errors="replace")
        header = HEADER.findall(text)[-1]
        assert int(header[0]) >= 1 and header[1] == "100000", header
        assert float(header[2]) > 0, header  # the swarm's tokens/s, summed over the data holders

        os.killpg(demo.pid, signal.SIGINT)  # Ctrl+C
        end = time.monotonic() + 90
        while demo.poll() is None and time.monotonic() < end:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        try:  # the terminal closes as it exits: wait for the exit status itself (bounded)
            code = demo.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        assert code == 130, ANSI.sub(b"", seen)[-3000:].decode(errors="replace")
        assert (out / "loss.png").stat().st_size > 0  # written on Ctrl+C too
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows and all("lr" in r and len(r["grad_norms"]) == 3 and "microbatches_rerouted" in r for r in rows)
        for name in ("dh0", "dh1", "r1a", "r1b", "r2a", "r2b"):
            status = read_status(out / "nodes" / name / "status.json") or {}
            assert status.get("dead") is True and status.get("state") != "active", (name, status)
    finally:
        nodes = psutil.Process(demo.pid).children(recursive=True) if demo.poll() is None else []
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        for node in nodes:  # each node runs in its own session: the demo's group does not hold them
            try:
                node.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(nodes, timeout=10)
        demo.wait(timeout=30)
        os.close(master)
