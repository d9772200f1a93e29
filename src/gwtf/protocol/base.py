"""Vocabulary shared by every sans-IO protocol part: ids, messages, effects.

Owns: `NodeId`, the `Message` base class and its registry (the wire codec maps every registered
message type to msgpack and back), and the driver-agnostic effects (`Send`, `SetTimer`,
`CancelTimer`, `Log`). Protocol parts (flow routing, training, membership) define their own
message and effect classes in their own modules with the `@message` decorator.

Rules for message classes (so the codec can carry them without pickle):
- frozen, slotted dataclasses; field types limited to int, float, str, bool, None, bytes, and
  tuples / dicts of those (nested frozen dataclasses are not allowed: flatten them);
- `TYPE` is a short unique name; `tensor_bytes` says how many raw tensor bytes travel with the
  message (the simulator's network model charges them; the runtime attaches the real bytes).

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

NodeId = str
"""A node's id: unique in the swarm, stable for the node's life (a rejoin gets a new id)."""

M = TypeVar("M", bound="type[Message]")
K = TypeVar("K")
V = TypeVar("V")

MESSAGE_TYPES: dict[str, type[Message]] = {}
"""Registry: message TYPE name -> class. Filled by the `@message` decorator at import time."""


class IdentityMemo(Generic[K, V]):
    """`fn(obj)` memoised by the object's identity, for a pure `fn` of an immutable object that
    many cores share in one process (a simulation hands every receiver the same message or
    tuple): computed once per object instead of once per core. The entry holds the object, so
    its id cannot be reused while cached; the cache is dropped whole past `limit` entries."""

    __slots__ = ("_fn", "_limit", "_cache")

    def __init__(self, fn: Callable[[K], V], limit: int = 4096) -> None:
        self._fn, self._limit = fn, limit
        self._cache: dict[int, tuple[K, V]] = {}

    def __call__(self, obj: K) -> V:
        hit = self._cache.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        value = self._fn(obj)
        if len(self._cache) > self._limit:
            self._cache.clear()
        self._cache[id(obj)] = (obj, value)
        return value

    def put(self, obj: K, value: V) -> None:
        """Record `value` as `fn(obj)`, when the caller already holds it (it must be equal)."""
        if len(self._cache) > self._limit:
            self._cache.clear()
        self._cache[id(obj)] = (obj, value)


@dataclass(frozen=True, slots=True)
class Message:
    """Base class of everything that travels between nodes."""

    TYPE: ClassVar[str] = ""

    @property
    def tensor_bytes(self) -> int:
        """Raw tensor bytes carried beside the header (0 for control messages)."""
        return 0


def message(cls: M) -> M:
    """Class decorator: register a Message subclass under its TYPE (must be unique)."""
    name = cls.TYPE
    if not name:
        raise ValueError(f"{cls.__name__} has no TYPE")
    if name in MESSAGE_TYPES and MESSAGE_TYPES[name] is not cls:
        raise ValueError(f"message TYPE {name!r} registered twice")
    MESSAGE_TYPES[name] = cls
    return cls


# ---------------------------------------------------------------------------------------------
# Effects common to every part. Parts add their own (e.g. compute requests) in their modules.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Deliver `msg` to node `to`. A driver that cannot reaches the core's `on_send_failed`."""

    to: NodeId
    msg: Message


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Fire `on_timer(key)` at virtual/wall time `at` (seconds). Re-setting a key replaces it."""

    key: Any  # hashable, e.g. ("heartbeat",) or ("ack", mb_id)
    at: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    """Forget the timer `key` if it is set."""

    key: Any


@dataclass(frozen=True, slots=True)
class Log:
    """A structured log line: `event` plus key=value fields. Drivers write it; nothing else."""

    level: str  # "debug" | "info" | "warning" | "error"
    event: str
    fields: tuple[tuple[str, Any], ...] = ()


def log(level: str, event: str, **fields: Any) -> Log:
    """Shorthand: `log("warning", "refused", reason="stale")`."""
    return Log(level, event, tuple(fields.items()))
