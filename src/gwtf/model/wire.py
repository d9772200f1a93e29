"""Wire formats of the tensors that cross stage boundaries: activations and activation gradients.

Owns: the format names (`FORMATS`: "fp32", "bf16", "fp16", "int8"), `encode` (a float array ->
the arrays a frame carries), `decode` (those arrays, validated -> float32), `roundtrip` (what a
receiver gets: the local trainer's `train.local_rounding` uses it, so a swarm and the local
trainer round the same way, bit for bit) and `wire_bytes` (the exact body bytes of one encoded
tensor: the simulator and the core's cost model price messages with it). docs/wire-formats.md is
the narrative.

Formats (compute always stays float32; only the bytes on the wire change):
- "fp32": float32, 4 bytes per value (as computed).
- "bf16": bfloat16 bit patterns (round to nearest even, NaN kept NaN), 2 bytes per value; on the
  codec a uint16 array tagged "bfloat16".
- "fp16": IEEE half (numpy's rounding, nearest even), 2 bytes per value; magnitudes below ~6e-8
  flush to zero and above 65504 overflow to Inf (which the receiver refuses).
- "int8": blockwise absmax quantisation (the block layout of SWARM's released 8-bit blockwise
  compression, with a linear code instead of bitsandbytes' dynamic map): the flattened tensor is
  cut into blocks of `block_values` values; per block one float32 scale = absmax / 127 and int8
  codes round(x / scale) in [-127, 127]. Two arrays travel: the codes (int8, the tensor's shape)
  then the scales (float32, one per block). |error| <= scale / 2 per value.

The format of a received tensor is read from the arrays' dtype tags (the codec's tensor
descriptors), never from a separate claim; `decode` refuses (`WireFormatError`) an unknown tag,
a length that the shape and format do not imply, and non-finite or negative scales.
Pure numpy: must not import torch, asyncio, socket, threading or time (the simulator imports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

__all__ = ["BFLOAT16", "FORMATS", "WireFormat", "WireFormatError", "boundary_bytes", "check", "decode", "encode",
           "format_of", "roundtrip", "wire_bytes"]

WireFormat = Literal["fp32", "bf16", "fp16", "int8"]
FORMATS: tuple[str, ...] = get_args(WireFormat)

BFLOAT16 = np.dtype(np.uint16, metadata={"wire": "bfloat16"})
"""The codec's bfloat16 tag (`gwtf.runtime.codec.BFLOAT16` is the same dtype): raw bit patterns."""

ALIGN_BYTES = 8  # the codec starts every tensor of a frame body at a multiple of this
INT8_MAX = 127


class WireFormatError(ValueError):
    """Received arrays are not a valid encoding of a tensor; the message names what is wrong."""


def _blocks(numel: int, block_values: int) -> int:
    return -(-numel // block_values)


def wire_bytes(numel: int, fmt: str, block_values: int = 4096) -> int:
    """Exact frame-body bytes of one tensor of `numel` values in format `fmt` (codec padding included)."""
    if numel < 0 or block_values < 1:
        raise ValueError("numel must be >= 0 and block_values >= 1")
    if fmt == "fp32":
        return 4 * numel
    if fmt in ("bf16", "fp16"):
        return 2 * numel
    if fmt == "int8":
        return numel + (-numel % ALIGN_BYTES) + 4 * _blocks(numel, block_values)
    raise ValueError(f"unknown wire format {fmt!r}; known: {', '.join(FORMATS)}")


def boundary_bytes(numel: int, activations: str, gradients: str, block_values: int = 4096) -> tuple[int, int]:
    """(activation, activation gradient) bytes of one microbatch of `numel` boundary values."""
    return wire_bytes(numel, activations, block_values), wire_bytes(numel, gradients, block_values)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (torch's rule); NaN -> 0x7FC0."""
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def encode(array: np.ndarray, fmt: str, block_values: int = 4096) -> list[np.ndarray]:
    """The arrays that carry `array` (any float dtype) in format `fmt`, in frame order."""
    x = np.ascontiguousarray(array, dtype=np.float32)
    if fmt == "fp32":
        return [x]
    if fmt == "bf16":
        return [_bf16_bits(x).view(BFLOAT16)]
    if fmt == "fp16":
        return [x.astype(np.float16)]
    if fmt == "int8":
        if block_values < 1:
            raise ValueError("block_values must be >= 1")
        flat = x.reshape(-1)
        nb = _blocks(flat.size, block_values)
        padded = np.zeros(nb * block_values, np.float32)
        padded[: flat.size] = flat
        blocks = padded.reshape(nb, block_values)
        scales = (np.abs(blocks).max(axis=1) / np.float32(INT8_MAX)).astype(np.float32)
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        codes = np.clip(np.rint(blocks / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
        return [codes.reshape(-1)[: flat.size].reshape(x.shape), scales]
    raise ValueError(f"unknown wire format {fmt!r}; known: {', '.join(FORMATS)}")


def format_of(arrays: Sequence[np.ndarray]) -> str:
    """The format named by the arrays' dtype tags; WireFormatError if they name none."""
    dtypes = [a.dtype for a in arrays]
    if len(dtypes) == 1:
        meta = dtypes[0].metadata
        if meta is not None and meta.get("wire") == "bfloat16":
            return "bf16"
        if dtypes[0] == np.float32:
            return "fp32"
        if dtypes[0] == np.float16:
            return "fp16"
    if len(dtypes) == 2 and dtypes[0] == np.int8 and dtypes[1] == np.float32 and dtypes[1].metadata is None:
        return "int8"
    names = ", ".join(str(d) for d in dtypes) or "no array"
    raise WireFormatError(f"no wire format is carried as ({names})")


def check(arrays: Sequence[np.ndarray], block_values: int = 4096) -> str:
    """Validate received arrays without converting them; return their format.

    Refuses (WireFormatError): dtype tags naming no format; int8 scales that are not 1-D with
    exactly ceil(numel / block_values) entries, or not finite and >= 0; codes of -128 (the
    encoder never makes them). Non-finite float values are the caller's to check (the worker
    refuses NaN/Inf gradients).
    """
    fmt = format_of(arrays)
    if fmt != "int8":
        return fmt
    codes, scales = arrays
    numel = int(codes.size)
    nb = _blocks(numel, block_values)
    if scales.ndim != 1 or scales.size != nb:
        raise WireFormatError(f"int8 tensor of {numel} values needs {nb} scales (blocks of {block_values}), "
                              f"got shape {tuple(scales.shape)}")
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise WireFormatError("int8 scales must be finite and >= 0")
    if numel and int(codes.min()) < -INT8_MAX:
        raise WireFormatError("int8 code -128 is not produced by the encoder")
    return fmt


def decode(arrays: Sequence[np.ndarray], block_values: int = 4096) -> np.ndarray:
    """The tensor that valid received arrays carry, as a new float32 array (`check` first)."""
    fmt = check(arrays, block_values)
    if fmt == "fp32":
        return np.array(arrays[0], dtype=np.float32, copy=True)
    if fmt == "bf16":
        bits = arrays[0].view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)
    if fmt == "fp16":
        return arrays[0].astype(np.float32)
    codes, scales = arrays
    numel, nb = int(codes.size), int(scales.size)
    padded = np.zeros(nb * block_values, np.float32)
    padded[:numel] = codes.reshape(-1)
    out = padded.reshape(nb, block_values) * scales[:, None]
    return out.reshape(-1)[:numel].reshape(codes.shape)


def roundtrip(array: np.ndarray, fmt: str, block_values: int = 4096) -> np.ndarray:
    """What a receiver of `array` sent in `fmt` gets (float32): `decode(encode(...))`."""
    return decode(encode(array, fmt, block_values), block_values)

