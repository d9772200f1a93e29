"""Message dispatch by class, declared where each handler lives.

Owns: `Sender` (who may send a message), `Fence` (which term check it gets), `handles` (the
decorator a core part puts on its handler: `@handles(m.Commit, sender=Sender.LEADER,
fence=Fence.FROM_LEADER)`) and `routes_of(cls, parts)` (message class -> `Route` for a core
class, from the decorated methods of its parts' classes and of its MRO: a subclass's handler of
a message replaces its base's). A
message class no core part handles is the router's when its TYPE starts with "flow." or "swarm."
(`ROUTER_SENDERS` names the exceptions to the member rule), else unknown (logged, dropped).

Before this, one string table in core.py named the handler of each TYPE, a second who may send
it, and two tuples the term check; a baseline overrode `_resolve_handler` to claim its message.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Protocol, TypeVar

from gwtf.protocol.base import Message

__all__ = ["ROUTER_PREFIXES", "ROUTER_SENDERS", "Fence", "Route", "Sender", "Termed", "handles", "routes_of"]


class Sender(StrEnum):
    """Who may send a message type; `NodeCore.authorized` checks it before any handler runs, in
    both drivers. A member is a node in my directory (or my leader); a joiner not yet active
    accepts its contact's word, since it has no directory yet."""

    LEADER = "the current term's leader"  # and the term fence (`Membership.fence`)
    MEMBER = "a member"
    NEIGHBOUR = "a member of an adjacent stage"
    REPLICA = "a member of my stage"
    ANYONE = "any authenticated peer"  # the handler checks who it is (a joiner, a state source)


class Fence(IntEnum):
    """The term check a message gets before its handler (`Membership.fence`)."""

    NONE = 0
    FROM_LEADER = 1  # control only the current term's leader may send
    TO_LEADER = 2  # carries the sender's term to the leader (a newer one deposes the receiver)


@dataclass(frozen=True, slots=True)
class Route:
    """How a core handles one message class: its handler's name (None: the router's), who may
    send it and its term check."""

    handler: str | None
    sender: Sender
    fence: Fence = Fence.NONE
    part: str = ""  # the core's attribute holding the part whose method it is ("": the core's own)


ROUTER_PREFIXES = ("flow.", "swarm.")
ROUTER_SENDERS: dict[str, Sender] = {"flow.advert": Sender.ANYONE}
"""Router messages come from members, but a new member's adverts may arrive before its MemberUp
(the router keeps a bounded few)."""

class Termed(Protocol):
    """A fenced message: it carries its sender's term (`handles` checks every fenced class)."""

    term: int


_MARKS: dict[object, tuple[tuple[type[Message], ...], Sender, Fence]] = {}
"""Decorated handler -> its declaration. A table, not an attribute on the function: a method
compiled by mypyc (`gwtf simulate --compiled`) takes no attributes."""
F = TypeVar("F", bound=Callable[..., Any])


def handles(*classes: type[Message], sender: Sender, fence: Fence = Fence.NONE) -> Callable[[F], F]:
    """Declare the decorated method the handler of `classes` (one route per class)."""

    if fence is not Fence.NONE:
        for c in classes:
            if "term" not in getattr(c, "__dataclass_fields__", {}):
                raise TypeError(f"{c.__name__} is fenced ({fence.name}) but has no term field")

    def mark(fn: F) -> F:
        _MARKS[fn] = (classes, sender, fence)
        return fn

    return mark


def routes_of(cls: type, parts: Mapping[str, type] | None = None) -> dict[type, Route]:
    """Every message class the core class `cls` handles: from its parts' classes (`parts`:
    attribute name -> class), then from its MRO (a core's own handler wins, subclasses win)."""
    out: dict[type, Route] = {}
    for part, klass in [(name, k) for name, pcls in (parts or {}).items() for k in reversed(pcls.__mro__)] + \
            [("", k) for k in reversed(cls.__mro__)]:
        for name, fn in vars(klass).items():
            try:
                mark = _MARKS.get(fn)
            except TypeError:  # an unhashable class attribute is no handler
                continue
            if mark is None:
                continue
            classes, sender, fence = mark
            for mcls in classes:
                out[mcls] = Route(name, sender, fence, part)
    return out


def router_route(mcls: type) -> Route | None:
    """The route of a message no core part claims: the router's, or None (unknown)."""
    t = getattr(mcls, "TYPE", "")
    if t.startswith(ROUTER_PREFIXES):
        return Route(None, ROUTER_SENDERS.get(t, Sender.MEMBER))
    return None
