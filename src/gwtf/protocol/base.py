"""Vocabulary shared by every sans-IO protocol part: ids, messages, effects.

Owns: `NodeId`, the `Message` base class and its registry (the wire codec maps every registered
message type to msgpack and back), and the driver-agnostic effects (`Send`, `SetTimer`,
`CancelTimer`, `Log`; `RouterEffect`: the ones a router returns). Protocol parts (flow routing,
training, membership) define their own message and effect classes in their own modules with the
`@message` decorator; `messages.Effect` is the closed union of every effect.

Rules for message classes (so the codec can carry them without pickle):
- frozen, slotted dataclasses; field types limited to int, float, str, bool, None, bytes, and
  tuples / dicts of those (nested frozen dataclasses are not allowed: flatten them);
- `TYPE` is a short unique name; `tensor_bytes` says how many raw tensor bytes travel with the
  message (the simulator's network model charges them; the runtime attaches the real bytes);
- `@message` also swaps in a faster constructor (`fast_init`), so no `default_factory` and no
  `__post_init__` (it refuses them at import).

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

from gwtf.ids import NodeId as NodeId  # the shared vocabulary (a leaf module)

M = TypeVar("M", bound="type[Message]")
T = TypeVar("T", bound=type)
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
    return fast_init(cls)


def fast_init(cls: T) -> T:
    """Class decorator, outside `@dataclass(frozen=True, slots=True)`: the same `__init__`
    (signature, defaults, frozen instance), setting each field through its slot descriptor.

    A frozen dataclass's generated `__init__` sets every field with `object.__setattr__(self,
    "name", value)`, a generic attribute lookup per field; the slot's own `__set__` skips it.
    Messages and effects are built a few times per simulated event: a 6-field message took 2.5
    instead of 0.95 us to build. Only the constructor changes; assignment after it still raises."""
    if "__post_init__" in dir(cls):
        raise TypeError(f"fast_init: {cls.__name__} has __post_init__")
    namespace: dict[str, Any] = {}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for i, f in enumerate(dataclasses.fields(cls)):
        if not f.init or f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"fast_init: {cls.__name__}.{f.name} needs the dataclass __init__")
        slot = next(c.__dict__[f.name] for c in cls.__mro__ if f.name in c.__dict__)
        namespace[f"_set{i}"] = slot.__set__
        param = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default{i}"] = f.default
            param += f"=_default{i}"
        (keyword if f.kw_only else positional).append(param)
        body.append(f"    _set{i}(self, {f.name})")
    params = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    exec(f"def __init__({params}):\n" + "\n".join(body or ["    pass"]), namespace)
    init = namespace["__init__"]
    generated = cls.__dict__["__init__"]  # the dataclass's own
    if _signature(init) != _signature(generated):  # e.g. an InitVar the fields do not show
        raise TypeError(f"fast_init: {cls.__name__}'s fields do not give its __init__'s signature")
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = generated.__doc__
    cls.__init__ = init  # type: ignore[misc]
    return cls


def _signature(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# ---------------------------------------------------------------------------------------------
# Effects common to every part. Parts add their own (e.g. compute requests) in their modules.
# ---------------------------------------------------------------------------------------------


@fast_init
@dataclass(frozen=True, slots=True)
class Send:
    """Deliver `msg` to node `to`. A driver that cannot reaches the core's `on_send_failed`."""

    to: NodeId
    msg: Message


@fast_init
@dataclass(frozen=True, slots=True)
class SetTimer:
    """Fire `on_timer(key)` at virtual/wall time `at` (seconds). Re-setting a key replaces it."""

    key: Any  # hashable, e.g. ("heartbeat",) or ("ack", mb_id)
    at: float


@fast_init
@dataclass(frozen=True, slots=True)
class CancelTimer:
    """Forget the timer `key` if it is set."""

    key: Any


@fast_init
@dataclass(frozen=True, slots=True)
class Log:
    """A structured log line: `event` plus key=value fields. Drivers write it; nothing else."""

    level: str  # "debug" | "info" | "warning" | "error"
    event: str
    fields: tuple[tuple[str, Any], ...] = ()


RouterEffect: TypeAlias = Send | SetTimer | CancelTimer
"""What a router returns (a subset of `messages.Effect`): its own messages and timers."""


def log(level: str, event: str, **fields: Any) -> Log:
    """Shorthand: `log("warning", "refused", reason="stale")`."""
    return Log(level, event, tuple(fields.items()))
