"""The status RPC: any live member answers `gwtf status HOST:PORT` with the whole swarm's table.

Owns the two runtime-level messages (their own registry `STATUS_TYPES`, decoded only on
authenticated connections, like the chunk messages, and never seen by the protocol core):

    client -> member   StatusRequest(req, scope="swarm")
    member -> client   StatusReply(req, rows, error)      on the same connection

`StatusService`, a member's side: scope "node" is answered with the member's own status row;
scope "swarm" by a data holder (it keeps every member in its directory) with its row plus the
"node" answers of every member it knows, asked in parallel under one deadline (a member that does
not answer in time gets a row in state "unreachable"); a relay (it keeps only the data holders
and its neighbours) passes a "swarm" request on to a data holder, and fans out over what it
knows itself if none answers. `fetch_status` is the client: a throw-away transport with a fresh
static key and the swarm secret, so a wrong secret fails the handshake (the member refuses it)
and nothing is read from an unauthenticated peer.

Every reply is validated field by field (`StatusReply.validate`): known row fields only, with
their types, bounded strings and a bounded number of rows. Must not import torch.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gwtf.protocol.base import Message, NodeId

__all__ = ["ROW_FIELDS", "STATUS_TYPES", "StatusReply", "StatusRequest", "StatusService", "fetch_status",
           "status_row"]

MAX_ROWS = 4096  # members in one reply
MAX_TEXT = 300  # characters of one string field (node ids embed an address)
MAX_CONCURRENT = 4  # "swarm" requests a member answers at once (each fans out to every member)

Value = str | int | float | bool | None
_INT = (int,)
_NUM = (int, float)
# field -> the types its value may have (None is always allowed)
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "node": (str,), "name": (str,), "role": (str,), "region": (str,), "state": (str,),
    "stop_reason": (str,), "stage": _INT, "iteration": _INT, "iterations": _INT, "stages": _INT, "in_flight": _INT,
    "microbatches": _INT, "crashes_seen": _INT, "joins_seen": _INT, "last_loss": _NUM,
    "tokens_per_s": _NUM, "iteration_s": _NUM, "compute_s": _NUM, "time_s": _NUM,
}


def _check_value(key: str, value: Value) -> None:
    if key not in ROW_FIELDS:
        raise ValueError(f"unknown row field {key[:40]!r}")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, ROW_FIELDS[key]):
        raise ValueError(f"row field {key!r} has the wrong type")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise ValueError(f"row field {key!r} too long")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"row field {key!r} not finite")


@dataclass(frozen=True, slots=True)
class StatusRequest(Message):
    """Ask a member for its own row ("node") or the whole swarm's ("swarm")."""

    TYPE = "STATUS_REQUEST"
    req: int
    scope: Literal["node", "swarm"]

    def validate(self) -> None:
        if not 0 <= self.req < 2**63:
            raise ValueError("bad request id")


@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    """The rows of request `req` (`ROW_FIELDS` only), or `error` when the member cannot answer."""

    TYPE = "STATUS_REPLY"
    req: int
    rows: tuple[dict[str, Value], ...]
    error: str = ""

    def validate(self) -> None:
        if not 0 <= self.req < 2**63:
            raise ValueError("bad request id")
        if len(self.rows) > MAX_ROWS or len(self.error) > MAX_TEXT:
            raise ValueError("reply too large")
        for row in self.rows:
            for key, value in row.items():
                _check_value(key, value)


STATUS_TYPES: dict[str, type[Message]] = {c.TYPE: c for c in (StatusRequest, StatusReply)}


def status_row(status: Mapping[str, Any]) -> dict[str, Value]:
    """The `ROW_FIELDS` of a status.json-like mapping, with their types (others dropped)."""
    row: dict[str, Value] = {}
    for key, types in ROW_FIELDS.items():
        value = status.get(key)
        if value is None or isinstance(value, bool):
            continue
        if float in types and isinstance(value, int):
            value = float(value)
        if isinstance(value, str) and str in types:
            row[key] = value[:MAX_TEXT]
        elif isinstance(value, (int, float)) and isinstance(value, types) and math.isfinite(value):
            row[key] = value
    return row


Ask = Callable[[str, StatusRequest, float], Awaitable[StatusReply | None]]
"""Send a request to an address and await its reply; None when none came (unreachable, refused,
timed out: `Transport.request`'s SendFailed)."""


class StatusService:
    """A member's side of the status RPC (see the module docstring).

    Args:
        own_row: this node's current status (as status.json holds it).
        peers: the members this node knows, with their stages (its directory, itself excluded).
        addr_of: a member's address ("host:port") from its node id.
        ask: sends one request and awaits its reply (None: no reply).
        timeout_s: the deadline of every request this member sends on.
    """

    def __init__(self, own_row: Callable[[], Mapping[str, Any]], peers: Callable[[], Mapping[NodeId, int]],
                 addr_of: Callable[[NodeId], str], ask: Ask, timeout_s: float) -> None:
        self.own_row = own_row
        self.peers = peers
        self.addr_of = addr_of
        self.ask = ask
        self.timeout_s = timeout_s
        self._busy = 0

    async def answer(self, msg: StatusRequest) -> StatusReply:
        if msg.scope == "node":
            return StatusReply(req=msg.req, rows=(status_row(self.own_row()),))
        if self._busy >= MAX_CONCURRENT:
            return StatusReply(req=msg.req, rows=(), error="busy: too many status requests at once")
        self._busy += 1
        try:
            return StatusReply(req=msg.req, rows=tuple(await self._swarm_rows()))
        finally:
            self._busy -= 1

    async def _swarm_rows(self) -> list[dict[str, Value]]:
        own = status_row(self.own_row())
        peers = dict(self.peers())
        if own.get("stage") != 0:  # a relay: a data holder knows every member
            for pid in sorted(p for p, stage in peers.items() if stage == 0):
                reply = await self._ask(pid, "swarm")
                if reply is not None and not reply.error and reply.rows:
                    return list(reply.rows)
        return [own, *await self._node_rows(sorted(peers))]

    async def _node_rows(self, pids: Sequence[NodeId]) -> list[dict[str, Value]]:
        async def one(pid: NodeId) -> dict[str, Value]:
            reply = await self._ask(pid, "node")
            if reply is None or reply.error or len(reply.rows) != 1:
                return {"node": pid[:MAX_TEXT], "name": pid.partition("~")[0][:MAX_TEXT], "state": "unreachable"}
            return reply.rows[0]

        return list(await asyncio.gather(*(one(p) for p in pids)))

    async def _ask(self, pid: NodeId, scope: Literal["node", "swarm"]) -> StatusReply | None:
        try:
            addr = self.addr_of(pid)
        except ValueError:  # an id without an address
            return None
        return await self.ask(addr, _request(scope), self.timeout_s)


def _request(scope: Literal["node", "swarm"]) -> StatusRequest:
    return StatusRequest(req=secrets.randbits(62), scope=scope)


async def fetch_status(addr: str, secret: bytes, timeout_s: float, connect_timeout_s: float = 5.0) -> list[dict[str, Value]]:
    """Ask the member at `addr` for the swarm's rows.

    Raises:
        SendFailed: unreachable, handshake refused (a wrong swarm secret), or no reply in time.
        ValueError: the member answered with an error.
    """
    from gwtf.config import RuntimeConfig
    from gwtf.runtime.transport import Transport

    cfg = RuntimeConfig(connect_timeout_s=connect_timeout_s, request_timeout_s=timeout_s)
    transport = Transport.with_new_key("status", secret, lambda *_: None, cfg)
    try:
        reply = await transport.request(addr, _request("swarm"), timeout_s)
    finally:
        await transport.close()
    if reply.error:
        raise ValueError(reply.error)
    return list(reply.rows)
