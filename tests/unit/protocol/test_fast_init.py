"""`fast_init`: the same constructor as the frozen dataclass's own, only faster."""

from __future__ import annotations

import dataclasses

import pytest

from gwtf.protocol.base import MESSAGE_TYPES, Send, fast_init
from gwtf.protocol.messages import Compute, Forward


def test_keeps_signature_defaults_and_frozenness() -> None:
    c = Compute(1, "forward", 2, ("d0", 0, 1), 3.0, outputs=(("act",),))
    assert (c.inputs, c.outputs, c.size_bytes, c.count) == ((), (("act",),), 0, 0)
    assert c == Compute(1, "forward", 2, ("d0", 0, 1), 3.0, (), (("act",),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kind = "backward"  # type: ignore[misc]
    f = Forward(mb=("d0", 0, 1), flow_id=0, path=(), legs=(), key=("act",), size_bytes=8)
    assert f.until == -1 and f.size_bytes == 8
    with pytest.raises(TypeError):
        Forward(("d0", 0, 1), 0, (), (), ("act",))  # type: ignore[misc]  # kw_only stays kw_only
    with pytest.raises(TypeError):
        Send("n1")  # type: ignore[call-arg]
    assert Send.__init__.__qualname__ == "Send.__init__"


def test_every_message_has_a_fast_constructor() -> None:
    for cls in MESSAGE_TYPES.values():
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
        assert "_set0" in cls.__init__.__code__.co_names or not dataclasses.fields(cls)


def test_refuses_what_it_cannot_copy() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class WithFactory:
        xs: tuple[int, ...] = dataclasses.field(default_factory=tuple)

    with pytest.raises(TypeError, match="xs"):
        fast_init(WithFactory)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithPost:
        x: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="__post_init__"):
        fast_init(WithPost)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:  # an InitVar is a parameter that `fields` does not list
        x: int
        y: dataclasses.InitVar[int] = 0

    with pytest.raises(TypeError, match="signature"):
        fast_init(WithInitVar)
