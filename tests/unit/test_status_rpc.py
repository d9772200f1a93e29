"""The status RPC on loopback, in process: a relay passes `gwtf status` on to a data holder, which
asks every member; a wrong secret and an unreachable member fail; replies are validated.

Every test runs its own event loop under an overall deadline; every await inside is bounded.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gwtf.cli import main
from gwtf.config import RuntimeConfig
from gwtf.runtime.codec import Decoder, WireError, encode_bytes
from gwtf.runtime.statusrpc import (
    STATUS_TYPES,
    StatusReply,
    StatusRequest,
    StatusService,
    fetch_status,
    status_row,
)
from gwtf.runtime.transport import SendFailed, Transport

SECRET = b"status-secret-of-sufficient-length"
FAST = RuntimeConfig(connect_timeout_s=2.0, request_timeout_s=5.0)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30.0))


class Member:
    """A transport answering status requests for a fake node row."""

    def __init__(self, name: str, stage: int, role: str) -> None:
        self.t = Transport.with_new_key(name, SECRET, lambda *_: None, FAST)
        self.row: dict[str, Any] = {"name": name, "node": self.t.node_id, "stage": stage, "role": role,
                                    "state": "active", "iteration": 4, "iterations": 10, "microbatches": 8,
                                    "tokens_per_s": 1500.0, "iteration_s": 0.25, "last_loss": 3.5,
                                    "secret_thing": "never sent"}
        self.peers: dict[str, int] = {}
        self.addrs: dict[str, str] = {}

    async def start(self) -> str:
        self.addr = await self.t.start("127.0.0.1", 0)

        async def ask(addr: str, msg: StatusRequest, timeout_s: float) -> StatusReply | None:
            try:
                return await self.t.request(addr, msg, timeout_s)
            except SendFailed:
                return None

        self.t.on_status = StatusService(lambda: self.row, lambda: self.peers, lambda pid: self.addrs[pid], ask,
                                         timeout_s=2.0).answer
        return self.addr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_any_member_returns_every_members_row() -> None:
    async def body() -> None:
        dh, relay, gone = Member("dh0", 0, "data-holder"), Member("r1a", 1, "relay"), "r1b~dead"
        await dh.start()
        await relay.start()
        dh.peers = {relay.t.node_id: 1, gone: 1}
        dh.addrs = {relay.t.node_id: relay.addr, gone: f"127.0.0.1:{_free_port()}"}
        relay.peers = {dh.t.node_id: 0}
        relay.addrs = {dh.t.node_id: dh.addr}
        try:
            for addr in (relay.addr, dh.addr):  # the relay passes it on to the data holder
                rows = await fetch_status(addr, SECRET, timeout_s=8.0, connect_timeout_s=2.0)
                by_name = {r["name"]: r for r in rows}
                assert set(by_name) == {"dh0", "r1a", "r1b"}, rows
                assert by_name["r1a"]["tokens_per_s"] == 1500.0 and by_name["r1a"]["microbatches"] == 8
                assert by_name["r1b"]["state"] == "unreachable"
                assert all("secret_thing" not in r for r in rows)
        finally:
            await dh.t.close()
            await relay.t.close()

    run(body)


def test_wrong_secret_and_unreachable_member_fail() -> None:
    async def body() -> None:
        dh = Member("dh0", 0, "data-holder")
        await dh.start()
        try:
            with pytest.raises(SendFailed, match="secret|handshake|closed"):
                await fetch_status(dh.addr, b"another-secret-of-sufficient-len", timeout_s=4.0, connect_timeout_s=2.0)
            with pytest.raises(SendFailed):
                await fetch_status(f"127.0.0.1:{_free_port()}", SECRET, timeout_s=4.0, connect_timeout_s=2.0)
        finally:
            await dh.t.close()

    run(body)


def _roundtrip(msg: StatusReply | StatusRequest) -> Any:
    frames = Decoder(registry=STATUS_TYPES).feed(encode_bytes(msg))
    assert len(frames) == 1
    return frames[0].msg


def test_status_messages_are_validated_like_every_message() -> None:
    ok = StatusReply(req=7, rows=(status_row({"name": "a", "stage": 1, "last_loss": 2, "bogus": 1}),))
    back = _roundtrip(ok)
    assert back == ok and back.rows[0] == {"name": "a", "stage": 1, "last_loss": 2.0}
    for bad in (
        StatusReply(req=1, rows=({"password": "x"},)),  # unknown field
        StatusReply(req=1, rows=({"stage": "one"},)),  # wrong type
        StatusReply(req=1, rows=({"name": "x" * 1000},)),  # too long
        StatusReply(req=1, rows=({"last_loss": float("nan")},)),
        StatusReply(req=-1, rows=()),
    ):
        with pytest.raises(WireError):
            _roundtrip(bad)
    with pytest.raises(WireError):
        Decoder(registry=STATUS_TYPES).feed(encode_bytes(StatusRequest(req=1, scope="everything")))  # type: ignore[arg-type]


class _Background:
    """A data-holder member answering status requests on its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.member = Member("dh0", 0, "data-holder")
        self.addr = asyncio.run_coroutine_threadsafe(self.member.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.member.t.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_status_command_prints_the_table_and_refuses_a_wrong_secret(tmp_path: Any, capsys: Any) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_bytes(SECRET)
    bad.write_bytes(b"another-secret-of-sufficient-len")
    member = _Background()
    try:
        assert main(["status", member.addr, "--secret-file", str(good), "--timeout-s", "8"]) == 0
        out = capsys.readouterr().out
        assert "iteration 5/10" in out and "dh0" in out and "1500" in out
        assert main(["status", member.addr, "--secret-file", str(bad), "--timeout-s", "4"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"gwtf: error: no status from {member.addr}"), err
    finally:
        member.close()
    port = _free_port()
    assert main(["status", f"127.0.0.1:{port}", "--secret-file", str(good), "--timeout-s", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gwtf: error: no status from 127.0.0.1:{port}"), err
