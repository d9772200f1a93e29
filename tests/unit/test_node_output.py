"""What a user sees from `gwtf node` and `gwtf status` (issue 44 item 4): the node's own
stdout.log (a tee of stdout and stderr, never doubled under the launcher's redirect), the
SERVING line, the member lost/joined lines, and `gwtf status` printed uncut to a pipe."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from gwtf.commands import status as status_command
from gwtf.commands.node import tee_output
from gwtf.config import load_config
from gwtf.protocol.kinds import RecordName
from gwtf.runtime.watch import member_line, member_lines, member_snapshot, print_full_width, render_watch

ROOT = Path(__file__).resolve().parents[2]


def test_the_tee_writes_the_terminal_and_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out_path, err_path = tmp_path / "term.out", tmp_path / "term.err"  # stand-ins for a terminal
    out = out_path.open("w", encoding="utf-8")
    err = err_path.open("w", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", out)  # (in the test: pytest's capture resets them after fixtures)
    monkeypatch.setattr(sys, "stderr", err)
    fd = sys.stdout.fileno()
    log_path = tmp_path / "stdout.log"
    log_path.write_text("an earlier start\n", encoding="utf-8")
    log_file = tee_output(log_path)
    assert log_file is not None
    try:
        print('READY {"port": 1}', flush=True)
        print("gwtf node dh0: a line on stderr", file=sys.stderr, flush=True)
        print("progress: dh0", flush=True)
        assert sys.stdout.fileno() == fd  # faulthandler gets the terminal's descriptor
        assert not sys.stdout.isatty()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        log_file.close()
        out.close()
        err.close()
    assert log_path.read_text(encoding="utf-8").splitlines() == [
        "an earlier start", 'READY {"port": 1}', "gwtf node dh0: a line on stderr", "progress: dh0"]  # appended
    assert out_path.read_text(encoding="utf-8").splitlines() == ['READY {"port": 1}', "progress: dh0"]
    assert err_path.read_text(encoding="utf-8").splitlines() == ["gwtf node dh0: a line on stderr"]


def test_no_tee_when_stdout_already_is_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_path = tmp_path / "stdout.log"
    with log_path.open("a", encoding="utf-8") as redirected:  # what the launcher hands the node
        monkeypatch.setattr(sys, "stdout", redirected)
        monkeypatch.setattr(sys, "stderr", redirected)
        assert tee_output(log_path) is None
        assert sys.stdout is redirected and sys.stderr is redirected
        print('READY {"port": 1}', flush=True)
    assert log_path.read_text(encoding="utf-8").splitlines() == ['READY {"port": 1}']


def test_a_node_process_under_the_launchers_redirect_writes_each_line_once(tmp_path: Path) -> None:
    """A real process, its stdout and stderr on the log file (as `launcher.spawn` starts nodes)."""
    log_path = tmp_path / "stdout.log"
    script = ("import sys; from pathlib import Path; from gwtf.commands.node import tee_output; "
              f"assert tee_output(Path({str(log_path)!r})) is None; "
              "print('READY {}', flush=True); print('on stderr', file=sys.stderr, flush=True)")
    with log_path.open("wb") as out:
        proc = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=60, check=False, cwd=ROOT)
    text = log_path.read_text(encoding="utf-8")
    assert proc.returncode == 0, text
    assert text.splitlines() == ["READY {}", "on stderr"]


def test_a_terminal_that_went_away_leaves_the_log_going(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Gone(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(sys, "stdout", Gone())
    monkeypatch.setattr(sys, "stderr", Gone())
    log_path = tmp_path / "stdout.log"
    log_file = tee_output(log_path)
    assert log_file is not None
    try:
        print("first", flush=True)
        print("second", file=sys.stderr, flush=True)
    finally:
        log_file.close()
    assert log_path.read_text(encoding="utf-8").splitlines() == ["first", "second"]


def _peer(stage: int, shard: int = -1) -> SimpleNamespace:
    return SimpleNamespace(stage=stage, shard=shard)


def test_member_lines_name_the_member_its_stage_and_the_count() -> None:
    assert member_line("r1a~f00d/local@127.0.0.1:4000", 1, -1, "lost", 5) == "member r1a (stage 1) lost; 5 members"
    assert (member_line("j0~beef/eu@10.0.0.9:7000", 0, 1, "joined", 6)
            == "member j0 (stage 0, data holder, shard 1) joined; 6 members")
    assert member_line("x", -1, -1, "lost", 1) == "member x (no stage) lost; 1 member"
    me = "dh1~aa/local@h:2"
    before = member_snapshot({me: _peer(0, 1), "dh0~bb/local@h:1": _peer(0, 0), "r1a~cc/local@h:3": _peer(1),
                              "r2a~dd/local@h:4": _peer(2)})
    after = member_snapshot({me: _peer(2), "dh0~bb/local@h:1": _peer(0, 0), "j0~ee/local@h:5": _peer(1)})
    assert member_lines(before, after, me) == [
        "member r1a (stage 1) lost; 3 members",
        "member r2a (stage 2) lost; 2 members",
        "member j0 (stage 1) joined; 3 members",
    ]  # this node itself (its stage changed) is never a line
    assert member_lines(before, before, me) == []


class _FakeCore:
    def __init__(self, me: str) -> None:
        self.me = SimpleNamespace(id=me, stage=1, shard=-1, compute_s=0.0)
        self.directory: dict[str, Any] = {me: self.me, "dh0~bb/local@h:1": _peer(0, 0)}
        self.active = True


class _FakeHost:
    def __init__(self, me: str) -> None:
        self.core = _FakeCore(me)
        self.role = "relay"

    @property
    def stage(self) -> int | None:
        return self.core.me.stage if self.core.me.stage >= 0 else None

    def in_flight(self) -> int:
        return 0


def test_serving_line_once_per_stage_then_member_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gwtf.runtime.node import NodeIdentity, NodeRuntime

    ident = NodeIdentity(name="j1", role="relay", stage=None, region="local", shard=None, listen="127.0.0.1:0",
                         join="127.0.0.1:1", device="cpu", out_dir=tmp_path)
    rt = NodeRuntime(load_config(None, []), ident)
    try:
        rt.node_id = "j1~ab/local@127.0.0.1:5"
        host = _FakeHost(rt.node_id)
        rt.host = host  # type: ignore[assignment]
        rt.state = "joining"
        rt._check_members()  # not serving yet: no member lines
        rt._track_stats(RecordName.ACTIVATED, {"node": rt.node_id, "stage": 1, "version": 4})
        rt._track_stats(RecordName.ACTIVATED, {"node": rt.node_id, "stage": 1, "version": 4})  # a repeat
        out = capsys.readouterr().out.splitlines()
        serving = [line for line in out if line.startswith("SERVING ")]
        assert len(serving) == 1, out
        assert json.loads(serving[0][len("SERVING "):]) == {
            "node": rt.node_id, "name": "j1", "role": "relay", "stage": 1, "shard": None}
        assert rt.state == "active"
        host.core.directory.pop("dh0~bb/local@h:1")
        host.core.directory["j0~ee/eu@h:6"] = _peer(0, 1)
        rt._check_members()
        rt._check_members()  # nothing changed since
        assert capsys.readouterr().err.splitlines() == [
            "gwtf node j1: member dh0 (stage 0, data holder, shard 0) lost; 1 member",
            "gwtf node j1: member j0 (stage 0, data holder, shard 1) joined; 2 members",
        ]
        host.core.me.stage = 2  # moved to another stage: serving again
        rt._serving(7)
        assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("SERVING ")] == [
            'SERVING {"node":"j1~ab/local@127.0.0.1:5","name":"j1","role":"relay","stage":2,"shard":null}']
    finally:
        rt.records.close()
        rt.executor.shutdown(wait=False)


ROWS = [
    {"name": "a-rather-long-data-holder-name-0", "role": "data-holder", "stage": 0, "region": "europe-west",
     "state": "active", "iteration": 123, "in_flight": 4, "microbatches": 4567, "last_loss": 4.1234,
     "tokens_per_s": 23456.0, "iteration_s": 1.25, "iterations": 300},
    {"name": "relay-in-a-faraway-place-1", "role": "relay", "stage": 1, "region": "asia-southeast",
     "state": "joining", "iterations": 300},
]
COLUMNS = ("node", "role", "stage", "region", "state", "iter", "in flight", "served", "last loss", "tokens/s",
           "s/iter")
VALUES = ("a-rather-long-data-holder-name-0", "relay-in-a-faraway-place-1", "data-holder", "europe-west",
          "asia-southeast", "active", "joining", "4567", "4.1234", "23456", "1.25")


def test_status_on_a_pipe_prints_every_column_in_full() -> None:
    cut = Console(file=io.StringIO(), width=80)
    cut.print(render_watch(ROWS, "gwtf swarm at 127.0.0.1:7000"))
    assert "…" in cut.file.getvalue()  # type: ignore[attr-defined]  # what rich's 80 columns did
    console = Console(file=io.StringIO(), width=80)
    print_full_width(console, render_watch(ROWS, "gwtf swarm at 127.0.0.1:7000"))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in text
    for word in (*COLUMNS, *VALUES, "iteration 124/300", "members by stage 0:1"):
        assert word in text, word


def test_gwtf_status_not_on_a_terminal_hints_at_json(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from gwtf.runtime import statusrpc

    async def fake_fetch(addr: str, secret: bytes, timeout_s: float, **kw: Any) -> list[dict[str, Any]]:
        return ROWS

    monkeypatch.setattr(statusrpc, "fetch_status", fake_fetch)
    monkeypatch.delenv("COLUMNS", raising=False)
    args = argparse.Namespace(addr="127.0.0.1:7000", timeout_s=1.0, json=False, secret_file=None, config=None,
                              overrides=[])
    assert status_command.run(args) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [status_command.JSON_HINT]
    assert "…" not in captured.out
    for word in (*COLUMNS, *VALUES):
        assert word in captured.out, word
    assert status_command.run(argparse.Namespace(**{**vars(args), "json": True})) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["rows"] == ROWS
