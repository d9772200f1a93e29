"""Wire codec: round trips, chunking, limits, validation, and a fuzz of >= 10,000 bad frames."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
import struct
import types
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gwtf.flow
import gwtf.protocol
from gwtf.protocol.base import MESSAGE_TYPES, Message
from gwtf.protocol.routing.messages import MOVE_KINDS
from gwtf.runtime.chunks import CHUNK_TYPES
from gwtf.runtime.codec import (
    BFLOAT16,
    PREFIX,
    Decoder,
    Limits,
    WireError,
    as_bfloat16,
    check_finite,
    encode,
    encode_bytes,
    require_finite,
)

for _pkg in (gwtf.protocol, gwtf.flow):  # importing registers every protocol message class
    for _mod in pkgutil.walk_packages(_pkg.__path__, prefix=f"{_pkg.__name__}."):
        try:
            importlib.import_module(_mod.name)
        except Exception as exc:  # a module being written right now: its own tests report it
            warnings.warn(f"test_codec: skipped messages of {_mod.name}: {exc!r}", stacklevel=1)


class Kind(enum.Enum):
    FWD = "fwd"
    BWD = "bwd"


@dataclass(frozen=True, slots=True)
class Sample(Message):
    """Test-only message using every allowed field type."""

    TYPE = "T_SAMPLE"
    mb: int
    loss: float
    node: str
    last: bool
    blob: bytes
    route: tuple[str, ...]
    pair: tuple[int, float]
    maybe: int | None
    costs: dict[str, float]
    kind: Literal["fwd", "bwd"]
    stage_kind: Kind
    extra: Any
    ids: list[int]


@dataclass(frozen=True, slots=True)
class Checked(Message):
    """Test-only message with a semantic `validate`."""

    TYPE = "T_CHECKED"
    stage: int

    def validate(self) -> None:
        if self.stage < 0:
            raise ValueError("stage must be >= 0")


REG: dict[str, type[Message]] = {"T_SAMPLE": Sample, "T_CHECKED": Checked}
ALL_REG: dict[str, type[Message]] = {**MESSAGE_TYPES, **CHUNK_TYPES, **REG}
SMALL = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 16)
INT64 = st.integers(-(2**63), 2**63 - 1)
SCALAR = st.one_of(st.none(), st.booleans(), INT64, st.floats(allow_nan=False), st.text(max_size=8))


def strategy(tp: Any) -> st.SearchStrategy[Any]:
    """Values for a field annotation (the codec's allowed types only)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    # Small values are likely to pass a message's semantic `validate` (ids, stages, nonce sizes).
    simple: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(0, 8) | INT64,
        float: st.floats(0.0, 10.0) | st.floats(allow_nan=False),
        str: st.text(min_size=1, max_size=12) | st.just(""),
        bool: st.booleans(),
        bytes: st.sampled_from([0, 1, 16, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
        type(None): st.none(), None: st.none(), Any: SCALAR,
    }
    if tp in simple:
        return simple[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy(a) for a in args])
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(strategy(args[0]), max_size=4).map(tuple)
    if origin is tuple:
        return st.tuples(*(strategy(a) for a in args))
    if origin is list:
        return st.lists(strategy(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(strategy(args[0]), strategy(args[1]), max_size=3)
    raise AssertionError(f"no strategy for {tp!r}")


FIELD_VALUES: dict[tuple[str, str], st.SearchStrategy[Any]] = {
    ("flow.propose", "kind"): st.sampled_from(sorted(MOVE_KINDS)),  # any other kind is refused
}


def instances(cls: type[Message]) -> st.SearchStrategy[Message]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: FIELD_VALUES[(cls.TYPE, f.name)] if (cls.TYPE, f.name) in FIELD_VALUES
              else strategy(hints[f.name]) for f in dataclasses.fields(cls) if f.init}
    return st.fixed_dictionaries(fields).map(lambda kw: _build(cls, kw))


def _build(cls: type[Message], kwargs: dict[str, Any]) -> Message:
    try:
        msg = cls(**kwargs)
        getattr(msg, "validate", lambda: None)()
    except (TypeError, ValueError):
        assume(False)
    return msg


TENSORS = st.lists(
    st.tuples(
        st.sampled_from(["float32", "float16", "float64", "int64", "int32", "uint8", "bfloat16"]),
        st.lists(st.integers(0, 5), max_size=3),
    ),
    max_size=3,
)


def make_tensors(specs: list[tuple[str, list[int]]]) -> list[np.ndarray]:
    out = []
    for i, (name, shape) in enumerate(specs):
        n = int(np.prod(shape))
        if name == "bfloat16":
            out.append(as_bfloat16(np.arange(n, dtype=np.uint16).reshape(shape)))
        else:
            out.append((np.arange(n) + i).astype(name).reshape(shape))
    return out


def decode_all(data: bytes, registry: dict[str, type[Message]] = ALL_REG, limits: Limits = SMALL) -> list:
    dec = Decoder(registry=registry, limits=limits)
    frames = dec.feed(data)
    dec.close()
    return frames


def assert_same(frames: list, msg: Message, tensors: list[np.ndarray]) -> None:
    assert len(frames) == 1
    got, got_tensors = frames[0]
    assert got == msg and type(got) is type(msg)
    assert len(got_tensors) == len(tensors)
    for a, b in zip(got_tensors, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert (a.dtype.metadata or {}).get("wire") == (b.dtype.metadata or {}).get("wire")


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_REG))
@settings(max_examples=25, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data(), specs=TENSORS)
def test_every_registered_type_round_trips(name: str, data: st.DataObject, specs: list) -> None:
    """For every message type: decode(encode(m, tensors)) == (m, tensors), types preserved."""
    msg = data.draw(instances(ALL_REG[name]))
    tensors = make_tensors(specs)
    assert_same(decode_all(encode_bytes(msg, tensors)), msg, tensors)


def test_registered_types_exist_and_are_frozen_slotted() -> None:
    """The codec carries dataclasses only; base.py requires frozen slotted ones."""
    for cls in ALL_REG.values():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert hasattr(cls, "__slots__"), cls


@settings(max_examples=60)
@given(msg=instances(Sample), specs=TENSORS, cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_chunked_feeding_equals_whole(msg: Message, specs: list, cuts: list[int]) -> None:
    """Any chunking of a stream of frames decodes to the same frames as one feed."""
    tensors = make_tensors(specs)
    stream = encode_bytes(msg, tensors) + encode_bytes(Checked(stage=3)) + encode_bytes(msg, tensors)
    whole = decode_all(stream)
    dec = Decoder(registry=ALL_REG, limits=SMALL)
    parts, start = [], 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts) + [len(stream)]:
        parts += dec.feed(memoryview(stream)[start:cut])
        start = cut
    dec.close()
    assert [p.msg for p in parts] == [w.msg for w in whole] == [msg, Checked(stage=3), msg]
    for p, w in zip(parts, whole):
        assert all(np.array_equal(a, b) for a, b in zip(p.tensors, w.tensors))


def test_zero_copy_buffer_path_matches_feed() -> None:
    """get_buffer/buffer_updated (the BufferedProtocol path) yields the same frames as feed."""
    big = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    stream = encode_bytes(Checked(stage=1), [big]) + encode_bytes(Checked(stage=2))
    dec = Decoder(registry=REG, limits=Limits())
    frames, pos = [], 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        n = min(len(buf), len(stream) - pos, 100_000)
        buf[:n] = stream[pos : pos + n]
        dec.buffer_updated(n)
        frames += dec.drain()
        pos += n
    assert [f.msg for f in frames] == [Checked(stage=1), Checked(stage=2)]
    assert np.array_equal(frames[0].tensors[0], big) and frames[0].tensors[0].flags.writeable


def test_encode_does_not_copy_contiguous_tensors() -> None:
    """The tensor buffers of `encode` are views of the caller's arrays."""
    arr = np.ones(1024, np.float32)
    buffers = encode(Checked(stage=0), [arr])
    arr[0] = 7.0
    assert np.frombuffer(buffers[-1], np.float32)[0] == 7.0


def test_bfloat16_tag_and_uint16_is_refused() -> None:
    bits = as_bfloat16(np.array([0x3F80, 0x4000], np.uint16))  # 1.0, 2.0
    (frame,) = decode_all(encode_bytes(Checked(stage=0), [bits]))
    assert frame.tensors[0].dtype == BFLOAT16 and frame.tensors[0].dtype.metadata == {"wire": "bfloat16"}
    with pytest.raises(WireError, match="not allowed"):
        encode(Checked(stage=0), [np.zeros(2, np.uint16)])


# --------------------------------------------------------------------------------------------
# Violations
# --------------------------------------------------------------------------------------------


def frame_with(header: Any, body: bytes = b"", magic: bytes = b"GWTF", version: int = 1) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(magic, version, 0, len(raw), len(body)) + raw + body


def reason(data: bytes, registry: dict[str, type[Message]] = ALL_REG) -> str:
    with pytest.raises(WireError) as info:
        decode_all(data, registry)
    return info.value.reason


def test_truncated_frame_is_incomplete_then_error_at_eof() -> None:
    data = encode_bytes(Checked(stage=1), [np.ones(10, np.float32)])
    dec = Decoder(registry=REG, limits=SMALL)
    assert dec.feed(data[:-1]) == [] and not dec.idle
    with pytest.raises(WireError, match="truncated"):
        dec.close()


def test_oversized_frame_rejected_from_prefix_alone() -> None:
    dec = Decoder(max_frame_bytes=1 << 16, registry=REG)
    with pytest.raises(WireError, match="frame too large"):
        dec.feed(PREFIX.pack(b"GWTF", 1, 0, 10, 1 << 40))
    with pytest.raises(WireError, match="frame too large"):
        encode(Checked(stage=0), [np.zeros(1 << 16, np.uint8)], Limits(max_frame_bytes=1 << 16))


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        ({"t": "NOPE", "f": {}, "x": []}, b"", "unknown type 'NOPE'"),
        ({"t": "T_CHECKED", "f": {"stage": "3"}, "x": []}, b"", "field 'stage' wrong type"),
        ({"t": "T_CHECKED", "f": {"stage": True}, "x": []}, b"", "field 'stage' wrong type"),
        ({"t": "T_CHECKED", "f": {"stage": 2**64 - 1}, "x": []}, b"", "out of int64 range"),
        ({"t": "T_CHECKED", "f": {}, "x": []}, b"", "missing field 'stage'"),
        ({"t": "T_CHECKED", "f": {"stage": 1, "z": 0}, "x": []}, b"", "unexpected field 'z'"),
        ({"t": "T_CHECKED", "f": {"stage": -1}, "x": []}, b"", "invalid T_CHECKED"),
        ({"t": "T_CHECKED", "f": {"stage": 1}, "x": [{"dtype": "complex64", "shape": [1], "nbytes": 8}]},
         bytes(8), "bad tensor dtype"),
        ({"t": "T_CHECKED", "f": {"stage": 1}, "x": [{"dtype": "float32", "shape": [3], "nbytes": 8}]},
         bytes(8), "tensor shape/nbytes mismatch"),
        ({"t": "T_CHECKED", "f": {"stage": 1}, "x": [{"dtype": "float32", "shape": [2], "nbytes": 8}]},
         bytes(12), "tensor shape/nbytes mismatch"),
        ({"t": "T_CHECKED", "f": {"stage": 1}, "x": [{"dtype": "uint8", "shape": [1] * 9, "nbytes": 1}]},
         bytes(1), "bad tensor shape"),
        ([1, 2], b"", "bad header map"),
    ],
)
def test_bad_headers_are_rejected_with_reason(header: Any, body: bytes, expected: str) -> None:
    assert expected in reason(frame_with(header, body))


def test_bad_prefix_and_encode_side_checks() -> None:
    assert reason(b"XXXX" + bytes(30)) == "bad magic"
    assert reason(b"GWXF") == "bad magic"  # detected before the whole prefix arrives
    assert "version" in reason(frame_with({"t": "T_CHECKED", "f": {"stage": 1}}, version=9))
    with pytest.raises(WireError, match="wrong type"):
        encode(Checked(stage="x"))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="too many tensors"):
        encode(Checked(stage=0), [np.zeros(1, np.uint8)] * 65)


def test_decoder_stays_failed_after_an_error() -> None:
    dec = Decoder(registry=REG, limits=SMALL)
    with pytest.raises(WireError):
        dec.feed(b"garbage!" * 4)
    with pytest.raises(WireError):
        dec.feed(encode_bytes(Checked(stage=1)))  # no resync: the connection is closed instead


def test_check_finite_names_nan_and_inf() -> None:
    ok = [np.ones(3, np.float32), np.arange(3), as_bfloat16(np.array([0x3F80], np.uint16))]
    assert check_finite(ok) is None
    require_finite(ok)
    bad = np.array([1.0, np.nan, np.inf, np.nan], np.float16)
    assert check_finite([ok[0], bad]) == "tensor 1: 2 NaN, 1 Inf"
    assert check_finite([as_bfloat16(np.array([0x7F80, 0x7FC0, 0xFF80], np.uint16))]) == "tensor 0: 1 NaN, 2 Inf"
    with pytest.raises(WireError, match="non-finite"):
        require_finite([bad])


# --------------------------------------------------------------------------------------------
# Fuzz: every example decodes several frames; frames in total: 1500*3 + 1000*3 + 800*2 + 1000*2
# = 11,100. Only WireError or valid frames are allowed, never another exception.
# --------------------------------------------------------------------------------------------

BASES = [
    encode_bytes(Checked(stage=5)),
    encode_bytes(Checked(stage=5), [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.int64)]),
    encode_bytes(Sample(mb=1, loss=0.5, node="n", last=True, blob=b"\x00", route=("a", "b"), pair=(1, 2.0),
                        maybe=None, costs={"x": 1.0}, kind="fwd", stage_kind=Kind.BWD, extra=[1, "a"], ids=[1])),
]


def decodes_cleanly(data: bytes) -> None:
    """The property: WireError, or frames whose messages are valid registered instances."""
    try:
        frames = decode_all(data)
    except WireError:
        return
    for msg, tensors in frames:
        assert type(msg) in ALL_REG.values()
        assert all(isinstance(t, np.ndarray) for t in tensors)


@settings(max_examples=1500)
@given(flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=4))
def test_fuzz_bit_flips(flips: list[int]) -> None:
    for base in BASES:
        data = bytearray(base)
        for f in flips:
            data[(f // 8) % len(data)] ^= 1 << (f % 8)
        decodes_cleanly(bytes(data))


@settings(max_examples=1000)
@given(cut=st.integers(0, 400), tail=st.binary(max_size=24))
def test_fuzz_truncate_and_append(cut: int, tail: bytes) -> None:
    for base in BASES:
        decodes_cleanly(base[: cut % (len(base) + 1)] + tail)


HEADER_VALUES = st.recursive(
    SCALAR | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
DESCRIPTORS = st.lists(
    st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "uint8", "q"]),
                           "shape": st.lists(st.integers(-2, 4), max_size=3), "nbytes": st.integers(-1, 64)}),
    max_size=2,
)
HEADERS = st.fixed_dictionaries(
    {"t": st.sampled_from([*ALL_REG, "", "x"]) | HEADER_VALUES},
    optional={"f": st.dictionaries(st.sampled_from(["mb", "stage", "node", "kind", "x"]), HEADER_VALUES)
              | HEADER_VALUES, "x": DESCRIPTORS | HEADER_VALUES},
)


@settings(max_examples=800)
@given(header=HEADERS | HEADER_VALUES, body=st.binary(max_size=64))
def test_fuzz_random_header_maps(header: Any, body: bytes) -> None:
    decodes_cleanly(frame_with(header, body))
    decodes_cleanly(frame_with(header))


@settings(max_examples=1000)
@given(data=st.binary(max_size=200))
def test_fuzz_garbage(data: bytes) -> None:
    decodes_cleanly(data)
    decodes_cleanly(b"GWTF\x01\x00" + data)


def test_prefix_layout_is_18_bytes_little_endian() -> None:
    """docs/wire.md: magic, version u8, flags u8, header_len u32, body_len u64."""
    data = encode_bytes(Checked(stage=1), [np.ones(1, np.float64)])
    magic, version, flags, header_len, body_len = struct.unpack_from("<4sBBIQ", data)
    assert (magic, version, flags, body_len) == (b"GWTF", 1, 0, 8)
    assert len(data) == 18 + header_len + body_len


def test_flow_advert_that_would_poison_the_distance_vector_is_refused() -> None:
    """An advert with a NaN or negative cost, duplicate targets or misaligned columns is refused at
    decode, naming the type; inf (no route) is a legal cost."""
    from gwtf.protocol.routing.messages import FlowAdvert

    bad = [(("a", "b"), (1.0, float("nan"))), (("a",), (-1.0,)), (("a", "a"), (1.0, 2.0)), (("a", "b"), (1.0,))]
    for targets, costs in bad:
        with pytest.raises(WireError, match="flow.advert"):
            decode_all(encode_bytes(FlowAdvert(targets, costs, True), []))
    ok = FlowAdvert(("a", "b"), (0.5, float("inf")), False)
    assert_same(decode_all(encode_bytes(ok, [])), ok, [])


def test_an_annealing_proposal_of_an_unknown_move_kind_is_refused() -> None:
    """Every FlowPropose kind has a move strategy (routing.moves); any other is refused at decode."""
    from gwtf.protocol.routing.messages import MOVE_KINDS, FlowPropose

    with pytest.raises(WireError, match="flow.propose"):
        decode_all(encode_bytes(FlowPropose("teleport", "d0", 1, "a", "b"), []))
    for kind in sorted(MOVE_KINDS):
        ok = FlowPropose(kind, "d0", 1, "a", "b")
        assert_same(decode_all(encode_bytes(ok, [])), ok, [])


def test_flow_load_out_of_range_is_refused() -> None:
    """A negative or absurd load (flow.load_aware prices a peer's compute by it) is refused at
    decode, naming the type."""
    from gwtf.protocol.routing.messages import FlowLoad

    for load in (-1, 10**7):
        with pytest.raises(WireError, match="flow.load"):
            decode_all(encode_bytes(FlowLoad(load), []))
    ok = FlowLoad(18)
    assert_same(decode_all(encode_bytes(ok, [])), ok, [])
