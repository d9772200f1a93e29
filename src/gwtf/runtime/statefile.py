"""A stage's state (weights + AdamW state) as safetensors bytes, without extra copies.

Owns the export and import of the state a joiner fetches: `pack` writes named tensors straight
into ONE preallocated uint8 buffer in the safetensors layout (8-byte little-endian header length,
JSON header, then the raw bytes; `safetensors.torch.load` reads it), and `views` reads such a
buffer back as tensors that are views of it (the header is JSON, validated; never unpickled), so
importing copies each tensor once, into the live module and optimizer, and never makes a second
full copy of the serialized bytes. Names follow `StageWorker.state_blob`: `w.<param>` for the
module's state_dict, `opt.<param>.<key>` for the optimizer's.

Must not import asyncio or socket.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from gwtf.runtime.worker import StageWorker

MAX_HEADER_BYTES = 64 * 2**20
_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in _DTYPES.items()}


def pack(tensors: Mapping[str, Tensor]) -> np.ndarray:
    """Named tensors (any device) as one safetensors buffer: each tensor is copied once, into it."""
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))  # keeps alignment
    header: dict[str, Any] = {}
    offset = 0
    for name, t in items:
        if t.dtype not in _DTYPES:
            raise ValueError(f"state tensor {name!r} has dtype {t.dtype}, which safetensors cannot carry")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    base = 8 + len(raw)
    blob = np.empty(base + offset, np.uint8)
    blob[:8] = np.frombuffer(len(raw).to_bytes(8, "little"), np.uint8)
    blob[8:base] = np.frombuffer(raw, np.uint8)
    for name, t in items:
        a, b = header[name]["data_offsets"]
        if b > a:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            torch.from_numpy(blob[base + a:base + b]).copy_(src)
    return blob


def views(blob: np.ndarray) -> dict[str, Tensor]:
    """The tensors of a safetensors buffer as views of it (ValueError if the header is malformed)."""
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.size < 8:
        raise ValueError("state must be a 1-d uint8 buffer of at least 8 bytes")
    n = int.from_bytes(blob[:8].tobytes(), "little")
    if n > min(blob.size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"state header of {n} bytes does not fit")
    header = json.loads(blob[8:8 + n].tobytes())
    if not isinstance(header, dict):
        raise ValueError("state header is not a map")
    data = blob[8 + n:]
    out: dict[str, Tensor] = {}
    for name, desc in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, a, b = _check_entry(name, desc, data.size)
        flat = torch.from_numpy(data[a:b]) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def _check_entry(name: str, desc: Any, data_bytes: int) -> tuple[torch.dtype, list[int], int, int]:
    ok = isinstance(desc, dict) and set(desc) == {"dtype", "shape", "data_offsets"}
    dtype = _BY_NAME.get(desc["dtype"]) if ok and isinstance(desc["dtype"], str) else None
    shape, offs = (desc["shape"], desc["data_offsets"]) if ok else (None, None)
    ok = (dtype is not None and isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
          and isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs))
    if not ok:
        raise ValueError(f"state tensor {str(name)[:64]!r}: bad descriptor")
    assert dtype is not None and shape is not None and offs is not None
    a, b = offs
    if not 0 <= a <= b <= data_bytes or b - a != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"state tensor {name[:64]!r}: offsets {a}..{b} do not match its shape or the buffer")
    return dtype, shape, a, b


def export_state(w: StageWorker) -> np.ndarray:
    """The worker's weights + optimizer state, as `StageWorker.state_blob` names them, in one buffer."""
    tensors: dict[str, Tensor] = {f"w.{k}": v for k, v in w.module.state_dict().items()}
    tensors.update(w.optimizer.state_tensors())
    return pack(tensors)


def import_state(w: StageWorker, blob: np.ndarray) -> None:
    """Install a state buffer into the worker: each tensor is copied once, from its view."""
    tensors = views(blob)
    weights = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
    w.module.load_state_dict(weights, strict=True)
    w.optimizer.load_state_tensors({k: v.to(w.device) for k, v in tensors.items() if k.startswith("opt.")})
