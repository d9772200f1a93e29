"""The wire codec: protocol messages plus raw tensors <-> length-prefixed frames. Pure, sans-IO.

Owns the frame layout (docs/wire.md), the generic field validation of every message class in a
registry (default `gwtf.protocol.base.MESSAGE_TYPES`), tensor descriptors and limits, the
incremental `Decoder`, and `check_finite`. Any violation of the format raises `WireError` with a
short reason; the transport then closes the connection (no resync). Never pickles, never evals.
Must not import asyncio, socket, threading, time or torch (it only moves bytes handed to it).

Frame = prefix | header | body. prefix = b"GWTF", version u8, flags u8, header_len u32,
body_len u64 (little endian). header = msgpack map {"t": TYPE, "f": {field: value}, "x": [tensor
descriptors]}; body = the tensors' raw little-endian bytes, each starting at an 8-byte aligned
offset (zero padding between them).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgpack
import numpy as np

from gwtf.protocol.base import MESSAGE_TYPES, Message

__all__ = [
    "BFLOAT16",
    "DTYPES",
    "Decoder",
    "Frame",
    "Limits",
    "MAGIC",
    "PREFIX",
    "VERSION",
    "WireError",
    "as_bfloat16",
    "body_tensors",
    "check_finite",
    "decode_header",
    "encode",
    "encode_bytes",
    "encode_parts",
    "frame_buffers",
    "require_finite",
    "wire_dtype_name",
]

MAGIC = b"GWTF"
VERSION = 1
PREFIX = struct.Struct("<4sBBIQ")  # magic, version, flags, header_len, body_len: 18 bytes
ALIGN_BYTES = 8  # every tensor starts at a multiple of this inside the body (max itemsize)

BFLOAT16 = np.dtype(np.uint16, metadata={"wire": "bfloat16"})
"""numpy has no bfloat16: the raw 16-bit patterns travel as uint16 tagged "bfloat16".
Build one with `as_bfloat16(bits_uint16)`; from torch: `t.view(torch.int16).numpy().view(BFLOAT16)`."""

DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": BFLOAT16,
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "int8": np.dtype("i1"),  # int8 codes of the blockwise 8-bit wire format (gwtf.model.wire)
}
_FLOAT_NAMES = ("float32", "float16", "float64")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class WireError(ValueError):
    """A frame (or a message to encode) violates the wire format; `reason` is short."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits every frame is checked against before anything is allocated."""

    max_frame_bytes: int = 256 * 2**20
    max_header_bytes: int = 2**20
    max_tensors: int = 64
    max_dims: int = 8
    max_container_len: int = 65536  # elements of one msgpack array or map in a header


class Frame(NamedTuple):
    """One decoded frame: the message and its tensors (writable views of one fresh body buffer)."""

    msg: Message
    tensors: list[np.ndarray]


def as_bfloat16(bits: np.ndarray) -> np.ndarray:
    """View a uint16/int16 array of bfloat16 bit patterns as the wire's bfloat16 dtype."""
    if bits.dtype.itemsize != 2 or bits.dtype.kind not in "ui":
        raise ValueError(f"bfloat16 bits must be a 16-bit integer array, got {bits.dtype}")
    return bits.view(BFLOAT16)


def wire_dtype_name(arr: np.ndarray) -> str:
    """The wire name of an array's dtype; ValueError if the dtype may not travel."""
    meta = arr.dtype.metadata
    if meta is not None and meta.get("wire") == "bfloat16":
        return "bfloat16"
    name = arr.dtype.newbyteorder("=").name if arr.dtype.byteorder in "<>" else arr.dtype.name
    if name not in DTYPES or name == "bfloat16":
        raise WireError(f"dtype {arr.dtype} not allowed")
    return name


# --------------------------------------------------------------------------------------------
# Field validation, compiled once per message class from its annotations
# --------------------------------------------------------------------------------------------

Conv = Callable[[Any, str], Any]
"""Checks one value against an annotation and converts it (wire form <-> Python form)."""


def _bad(path: str) -> WireError:
    return WireError(f"field {path!r} wrong type")


_LENIENT: dict[type, tuple[type, ...]] = {  # what encode accepts (decode is exact)
    int: (int, np.integer),
    float: (float, int, np.floating, np.integer),
    str: (str,),
    bool: (bool, np.bool_),
    bytes: (bytes, bytearray, memoryview),
}


def _scalar(tp: type, decode: bool) -> Conv:
    """Decode: exact type (bool is not int; an int may fill a float). Encode: numpy scalars ok."""

    def conv(v: Any, path: str) -> Any:
        if decode:
            ok = type(v) is tp or (tp is float and type(v) is int)
        else:
            ok = isinstance(v, _LENIENT[tp]) and (tp is bool or not isinstance(v, (bool, np.bool_)))
        if not ok:
            raise _bad(path)
        out = tp(v)
        if tp is int and not _INT64_MIN <= out <= _INT64_MAX:
            raise WireError(f"field {path!r} out of int64 range")
        return out

    return conv


def _any(v: Any, path: str, depth: int = 0) -> Any:
    """A value under `Any`: a nesting (max depth 16) of the wire types; lists decode to tuples."""
    if depth > 16:
        raise WireError(f"field {path!r} nested too deep")
    if v is None or type(v) in (bool, float, str, bytes):
        return v
    if type(v) is int:
        return _scalar(int, True)(v, path)
    if isinstance(v, (list, tuple)):
        return tuple(_any(x, path, depth + 1) for x in v)
    if isinstance(v, dict):
        return {_any(k, path, depth + 1): _any(x, path, depth + 1) for k, x in v.items()}
    raise _bad(path)


def _union(convs: list[Conv]) -> Conv:
    def conv(v: Any, path: str) -> Any:
        for c in convs:
            try:
                return c(v, path)
            except WireError:
                continue
        raise _bad(path)

    return conv


def _sequence(inner: list[Conv], variadic: bool, out: type) -> Conv:
    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, (list, tuple)) or (not variadic and len(v) != len(inner)):
            raise _bad(path)
        items = [(inner[0] if variadic else inner[i])(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return out(items)

    return conv


def _mapping(key: Conv, val: Conv) -> Conv:
    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            raise _bad(path)
        return {key(k, path): val(x, f"{path}[{k!r}]") for k, x in v.items()}

    return conv


def _literal(values: tuple[Any, ...]) -> Conv:
    def conv(v: Any, path: str) -> Any:
        if not any(type(v) is type(a) and v == a for a in values):
            raise WireError(f"field {path!r} not one of {values!r}"[:120])
        return v

    return conv


def _enum(tp: type[enum.Enum], decode: bool) -> Conv:
    def conv(v: Any, path: str) -> Any:
        if not decode:
            if not isinstance(v, tp):
                raise _bad(path)
            return v.value
        try:
            return tp(v)
        except (ValueError, TypeError):
            raise _bad(path) from None

    return conv


def _compile(tp: Any, decode: bool) -> Conv:
    """Build the checker/converter for annotation `tp` (TypeError if it cannot travel)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    tp = getattr(tp, "__supertype__", tp)  # typing.NewType
    if tp is Any or tp is object:
        return _any
    if tp is None or tp is type(None):
        return _literal((None,))
    if tp in (int, float, str, bool, bytes):
        return _scalar(tp, decode)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp, decode)
    if origin is Literal:
        return _literal(args)
    if origin in (typing.Union, types.UnionType):
        return _union([_compile(a, decode) for a in sorted(args, key=lambda a: a is not type(None))])
    out = tuple if decode else list  # msgpack carries lists; dataclasses get what they declare
    if tp in (tuple, list) or origin in (tuple, list):
        seq_out = out if (tp is tuple or origin is tuple) else list
        if not args:
            return _sequence([_any], True, seq_out)
        variadic = origin is list or (len(args) == 2 and args[1] is Ellipsis)
        return _sequence([_compile(a, decode) for a in args if a is not Ellipsis], variadic, seq_out)
    if tp is dict or origin is dict:
        key, val = (args if args else (Any, Any))
        return _mapping(_compile(key, decode), _compile(val, decode))
    raise TypeError(f"annotation {tp!r} cannot travel on the wire")


class _FieldSpec:
    """Per-class compiled converters for encode and decode."""

    def __init__(self, cls: type[Message]) -> None:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        try:
            self.enc = {n: _compile(hints[n], False) for n in names}
            self.dec = {n: _compile(hints[n], True) for n in names}
        except TypeError as exc:
            raise WireError(f"{cls.__name__}: {exc}") from None

    def encode(self, msg: Message) -> dict[str, Any]:
        return {n: conv(getattr(msg, n), n) for n, conv in self.enc.items()}

    def decode(self, raw: dict[Any, Any]) -> dict[str, Any]:
        for key in raw:
            if key not in self.dec:
                raise WireError(f"unexpected field {str(key)[:40]!r}")
        for name in self.dec:
            if name not in raw:
                raise WireError(f"missing field {name!r}")
        return {n: conv(raw[n], n) for n, conv in self.dec.items()}


_SPECS: dict[type[Message], _FieldSpec] = {}


def field_spec(cls: type[Message]) -> _FieldSpec:
    """The compiled field converters of a message class (cached)."""
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _FieldSpec(cls)
    return spec


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _padding(offset: int) -> int:
    return -offset % ALIGN_BYTES


def _tensor_views(tensors: Sequence[np.ndarray], limits: Limits) -> tuple[list[dict[str, Any]], list[Any]]:
    if len(tensors) > limits.max_tensors:
        raise WireError(f"too many tensors ({len(tensors)} > {limits.max_tensors})")
    descs: list[dict[str, Any]] = []
    views: list[Any] = []
    offset = 0
    for arr in tensors:
        if not isinstance(arr, np.ndarray):
            raise WireError(f"tensor must be a numpy array, got {type(arr).__name__}")
        name = wire_dtype_name(arr)
        if arr.ndim > limits.max_dims:
            raise WireError(f"tensor has {arr.ndim} dims (max {limits.max_dims})")
        wire = arr if arr.dtype.byteorder != ">" else arr.astype(DTYPES[name])
        wire = np.ascontiguousarray(wire)  # no copy when already contiguous
        pad = _padding(offset)
        if pad:
            views.append(bytes(pad))
        if wire.nbytes:
            views.append(memoryview(wire.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
        offset += pad + wire.nbytes
        descs.append({"dtype": name, "shape": list(arr.shape), "nbytes": int(wire.nbytes)})
    return descs, views


def encode_parts(
    msg: Message, tensors: Sequence[np.ndarray] = (), limits: Limits = Limits()
) -> tuple[bytes, list[bytes | memoryview], int]:
    """The msgpack header, the body buffers (tensors and padding) and the body length of a frame.

    The same checks as `encode` except the frame size: a chunked transfer (`runtime.chunks`)
    sends a header whose body travels in several frames.
    """
    cls = type(msg)
    if not getattr(cls, "TYPE", ""):
        raise WireError(f"{cls.__name__} has no TYPE")
    fields = field_spec(cls).encode(msg)
    descs, views = _tensor_views(tensors, limits)
    header = msgpack.packb({"t": cls.TYPE, "f": fields, "x": descs}, use_bin_type=True)
    if len(header) > limits.max_header_bytes:
        raise WireError("header too large")
    return header, views, sum(len(v) for v in views)


def encode(
    msg: Message, tensors: Sequence[np.ndarray] = (), limits: Limits = Limits()
) -> list[bytes | memoryview]:
    """Encode one frame as buffers to write in order: prefix+header, then tensor memoryviews.

    The tensors are not copied when they are C-contiguous little-endian arrays; keep them
    unchanged until the buffers are written. Raises WireError if the message's fields do not
    match its annotations, a dtype is not allowed, or a limit is exceeded.
    """
    return frame_buffers(*encode_parts(msg, tensors, limits), limits)


def frame_buffers(
    header: bytes, views: list[bytes | memoryview], body_len: int, limits: Limits = Limits()
) -> list[bytes | memoryview]:
    """One frame's buffers from `encode_parts`' result; WireError("frame too large") past the limit."""
    if PREFIX.size + len(header) + body_len > limits.max_frame_bytes:
        raise WireError("frame too large")
    prefix = PREFIX.pack(MAGIC, VERSION, 0, len(header), body_len)
    return [prefix + header, *views]


def encode_bytes(msg: Message, tensors: Sequence[np.ndarray] = (), limits: Limits = Limits()) -> bytes:
    """`encode` joined into one bytes object (tests, small control messages)."""
    return b"".join(bytes(b) for b in encode(msg, tensors, limits))


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def _unpack_header(raw: bytes | memoryview, limits: Limits) -> dict[str, Any]:
    """The header map; msgpack's own limits bound every string, bin, array and map (no ext types)."""
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=False, use_list=True, max_str_len=limits.max_header_bytes,
            max_bin_len=limits.max_header_bytes, max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise WireError(f"bad header: {type(exc).__name__}") from None
    if not isinstance(header, dict) or set(header) - {"t", "f", "x"} or "t" not in header:
        raise WireError("bad header map")
    return header


def _check_descs(raw: Any, limits: Limits) -> list[tuple[np.dtype[Any], tuple[int, ...], int, int]]:
    """Validate tensor descriptors; return (dtype, shape, offset, nbytes) per tensor."""
    if not isinstance(raw, list):
        raise WireError("bad tensor list")
    if len(raw) > limits.max_tensors:
        raise WireError("too many tensors")
    out = []
    offset = 0
    for d in raw:
        if not isinstance(d, dict) or set(d) != {"dtype", "shape", "nbytes"}:
            raise WireError("bad tensor descriptor")
        dtype = DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if dtype is None:
            raise WireError(f"bad tensor dtype {str(d['dtype'])[:32]!r}")
        shape, nbytes = d["shape"], d["nbytes"]
        if not isinstance(shape, list) or len(shape) > limits.max_dims:
            raise WireError("bad tensor shape")
        if not all(type(s) is int and 0 <= s < 2**62 for s in shape):
            raise WireError("bad tensor shape")
        if type(nbytes) is not int or nbytes != int(np.prod(shape, dtype=object)) * dtype.itemsize:
            raise WireError("tensor shape/nbytes mismatch")
        if nbytes > limits.max_frame_bytes:
            raise WireError("frame too large")
        offset += _padding(offset)
        out.append((dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    return out


def _build_message(header: Mapping[str, Any], registry: Mapping[str, type[Message]]) -> Message:
    name = header["t"]
    cls = registry.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"unknown type {str(name)[:40]!r}")
    raw_fields = header.get("f", {})
    if not isinstance(raw_fields, dict):
        raise WireError("bad field map")
    kwargs = field_spec(cls).decode(raw_fields)
    try:
        msg = cls(**kwargs)
        validate = getattr(msg, "validate", None)
        if validate is not None:
            validate()
    except (TypeError, ValueError) as exc:
        raise WireError(f"invalid {name}: {str(exc)[:80]}") from None
    return msg


Layout = list[tuple[np.dtype[Any], tuple[int, ...], int, int]]
"""(dtype, shape, offset in the body, nbytes) of each tensor of a frame."""


def decode_header(
    raw: bytes | memoryview, body_len: int, registry: Mapping[str, type[Message]], limits: Limits
) -> tuple[Message, Layout]:
    """Validate a header (as `encode_parts` made it) against `body_len`: the message and its layout.

    The checks of a frame's header; `limits.max_frame_bytes` caps each tensor (a chunked
    transfer passes its own cap). Raises WireError.
    """
    if len(raw) > limits.max_header_bytes:
        raise WireError("header too large")
    header = _unpack_header(raw, limits)
    layout = _check_descs(header.get("x", []), limits)
    end = layout[-1][2] + layout[-1][3] if layout else 0
    if end != body_len:
        raise WireError("tensor shape/nbytes mismatch")
    return _build_message(header, registry), layout


def body_tensors(body: np.ndarray, layout: Layout) -> list[np.ndarray]:
    """The tensors of a frame: views of its uint8 `body` as described by `layout`."""
    return [
        np.frombuffer(body, dtype, count=nbytes // dtype.itemsize, offset=off).reshape(shape)
        for dtype, shape, off, nbytes in layout
    ]


class Decoder:
    """Incremental frame decoder (h11 style): push bytes in any chunking, pull whole frames.

    Two ways to feed it: `feed(data)` (copies), or the zero-copy pair `get_buffer(hint)` /
    `buffer_updated(n)` that an asyncio BufferedProtocol forwards, so that large bodies are
    received straight into their final buffer; or, under the record layer (`runtime.auth.Opener`),
    `push(plaintext)` plus `body_window(n)` / `body_written(n)`, which let a record be decrypted
    straight into the pending tensor body. Then pull frames with `next_frame()` (one at a time:
    the caller may change `registry` between frames) or `drain()`.
    """

    _SCRATCH_BYTES = 256 * 1024

    def __init__(
        self,
        max_frame_bytes: int | None = None,
        registry: Mapping[str, type[Message]] | None = None,
        limits: Limits | None = None,
    ) -> None:
        base = limits or Limits()
        if max_frame_bytes is not None:
            base = dataclasses.replace(base, max_frame_bytes=max_frame_bytes,
                                       max_header_bytes=min(base.max_header_bytes, max_frame_bytes))
        self.limits = base
        self.registry: Mapping[str, type[Message]] = MESSAGE_TYPES if registry is None else registry
        self._buf = bytearray()  # unconsumed bytes (prefix, header, small bodies)
        self._pos = 0
        self._scratch = bytearray(0)  # allocated on the first get_buffer (the record layer never uses it)
        self._header_len = -1  # >= 0 once the prefix is parsed
        self._body_len = 0
        self._msg: Message | None = None  # set once the header is parsed
        self._layout: Layout = []
        self._body: np.ndarray | None = None
        self._filled = 0
        self._failed: WireError | None = None
        self._into_body = False  # whether get_buffer last handed out the body itself

    # -- input -------------------------------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Push `data` and return every frame it completes (raises WireError on a violation)."""
        self.push(data)
        return self.drain()

    def push(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer `data` without decoding (decode with `next_frame` / `drain`)."""
        self._buf += data

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next bytes: the body itself when a large body is pending."""
        self._into_body = False
        if self._body is not None and self._pos == len(self._buf):
            if self._body_len - self._filled >= self._SCRATCH_BYTES // 4:
                self._into_body = True
                return memoryview(self._body)[self._filled :]  # type: ignore[arg-type]
        if not self._scratch:
            self._scratch = bytearray(self._SCRATCH_BYTES)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        """Record `nbytes` written into the buffer last returned by `get_buffer`."""
        if self._into_body:
            self._filled += nbytes
        else:
            self._buf += memoryview(self._scratch)[:nbytes]

    def body_window(self, nbytes: int) -> memoryview | None:
        """The next `nbytes` of the pending tensor body, to be written in place (then call
        `body_written`), or None if no body is pending, bytes are buffered, or it is shorter."""
        if self._body is None or self._pos != len(self._buf) or self._body_len - self._filled < nbytes:
            return None
        return memoryview(self._body)[self._filled : self._filled + nbytes]  # type: ignore[arg-type]

    def body_written(self, nbytes: int) -> None:
        """Record `nbytes` written into the window last returned by `body_window`."""
        self._filled += nbytes

    # -- output ------------------------------------------------------------------------------

    def drain(self) -> list[Frame]:
        """All frames complete so far."""
        return list(self._frames())

    def _frames(self) -> Iterator[Frame]:
        while (frame := self.next_frame()) is not None:
            yield frame

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        if self._failed is not None:
            raise self._failed
        try:
            return self._step()
        except WireError as exc:
            self._failed = exc
            raise

    @property
    def idle(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return self._header_len < 0 and self._pos == len(self._buf)

    def close(self) -> None:
        """Signal end of stream: raises WireError("truncated") inside a partial frame."""
        if not self.idle:
            raise WireError("truncated")

    # -- state machine -----------------------------------------------------------------------

    def _available(self) -> int:
        return len(self._buf) - self._pos

    def _take(self, n: int) -> memoryview:
        view = memoryview(self._buf)[self._pos : self._pos + n]
        self._pos += n
        return view

    def _compact(self) -> None:
        if self._pos and (self._pos == len(self._buf) or self._pos > 1 << 20):
            del self._buf[: self._pos]
            self._pos = 0

    def _step(self) -> Frame | None:
        try:
            if self._header_len < 0 and not self._read_prefix():
                return None
            if self._msg is None and not self._read_header():
                return None
            return self._read_body()
        finally:
            self._compact()

    def _read_prefix(self) -> bool:
        if self._available() < PREFIX.size:
            if self._available() and self._buf[self._pos : self._pos + 4] != MAGIC[: self._available()]:
                raise WireError("bad magic")
            return False
        with self._take(PREFIX.size) as view:
            magic, version, flags, header_len, body_len = PREFIX.unpack(view)
        if magic != MAGIC:
            raise WireError("bad magic")
        if version != VERSION:
            raise WireError(f"unsupported version {version}")
        if flags != 0:
            raise WireError("unknown flags")
        if header_len > self.limits.max_header_bytes:
            raise WireError("header too large")
        if PREFIX.size + header_len + body_len > self.limits.max_frame_bytes:
            raise WireError("frame too large")
        self._header_len, self._body_len = header_len, body_len
        return True

    def _read_header(self) -> bool:
        if self._available() < self._header_len:
            return False
        with self._take(self._header_len) as view:
            header = _unpack_header(view, self.limits)
        layout = _check_descs(header.get("x", []), self.limits)
        end = layout[-1][2] + layout[-1][3] if layout else 0
        if end != self._body_len:
            raise WireError("tensor shape/nbytes mismatch")
        self._msg = _build_message(header, self.registry)
        self._layout = layout
        self._body = np.empty(self._body_len, np.uint8)
        self._filled = 0
        return True

    def _read_body(self) -> Frame | None:
        assert self._body is not None and self._msg is not None
        n = min(self._body_len - self._filled, self._available())
        if n:
            with self._take(n) as view:
                self._body[self._filled : self._filled + n] = np.frombuffer(view, np.uint8)
            self._filled += n
        if self._filled < self._body_len:
            return None
        body, msg = self._body, self._msg
        tensors = body_tensors(body, self._layout)
        self._header_len, self._msg, self._body, self._layout = -1, None, None, []
        return Frame(msg, tensors)


# --------------------------------------------------------------------------------------------
# Tensor sanity
# --------------------------------------------------------------------------------------------


def check_finite(arrays: Sequence[np.ndarray]) -> str | None:
    """None if every float tensor is finite, else a reason like "tensor 1: 3 NaN, 0 Inf"."""
    for i, arr in enumerate(arrays):
        name = wire_dtype_name(arr)
        if name == "bfloat16":
            bits = arr.view(np.uint16)
            special = (bits & 0x7F80) == 0x7F80  # exponent all ones: Inf or NaN
            if special.any():
                nan = int(np.count_nonzero(special & ((bits & 0x007F) != 0)))
                return f"tensor {i}: {nan} NaN, {int(np.count_nonzero(special)) - nan} Inf"
        elif name in _FLOAT_NAMES and not np.isfinite(arr).all():
            nan = int(np.count_nonzero(np.isnan(arr)))
            return f"tensor {i}: {nan} NaN, {int(np.count_nonzero(np.isinf(arr)))} Inf"
    return None


def require_finite(arrays: Sequence[np.ndarray]) -> None:
    """Raise WireError("non-finite tensor: ...") if any float tensor has NaN or Inf."""
    reason = check_finite(arrays)
    if reason is not None:
        raise WireError(f"non-finite tensor: {reason}")
