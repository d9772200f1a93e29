"""Where and in what precision a stage computes: device resolution, autocast, peak memory.

Owns: `resolve_device` (`train.device` / `--device`: "auto" = cuda when available, else cpu; a
request for cuda without CUDA is a one-line `UserError`), `compute_autocast` (`train.precision`:
"fp32" = no autocast; "bf16-autocast" = torch.autocast to bfloat16 around forward passes, the
weights, gradients and AdamW state staying float32: master weights), and `peak_memory_bytes`
(the process's peak: CUDA's max allocated on a GPU, the peak resident set otherwise).

The wire never sees the compute precision: activations and gradients leave a stage as float32
(`gwtf.runtime.worker.tensor_to_numpy` widens bfloat16), so nodes of different precision or device
interoperate. Must not import asyncio, socket, flow, protocol, sim or runtime.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from gwtf.errors import UserError

__all__ = ["DEVICES", "PRECISIONS", "compute_autocast", "cuda_unavailable_reason", "peak_memory_bytes",
           "resolve_device"]

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16-autocast")


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here (None when it can): a CPU-only torch build or no GPU visible."""
    if torch.cuda.is_available():
        return None
    built = torch.version.cuda
    if built is None:
        return f"torch {torch.__version__} built without CUDA"
    return f"torch {torch.__version__} built with CUDA {built}, but no GPU is visible"


def resolve_device(requested: str, flag: str = "--device") -> str:
    """"auto" | "cpu" | "cuda" -> the device to build stages on ("cpu" or "cuda").

    Raises UserError (one line naming `flag`) for an unknown name or for "cuda" without CUDA.
    """
    if requested not in DEVICES:
        raise UserError(f"{flag} {requested}: expected one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    reason = cuda_unavailable_reason()
    if requested == "auto":
        return "cpu" if reason else "cuda"
    if reason:
        raise UserError(f"{flag} cuda: CUDA is not available ({reason})")
    return "cuda"


def compute_autocast(device: str | torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """The context a forward pass runs in: none for fp32, bfloat16 autocast for "bf16-autocast".

    Only forward passes run inside it (autograd replays the same casts in backward); parameters
    stay float32, so the optimizer updates float32 master weights. On the CPU bf16 autocast works
    but is slow (no bf16 matmul units on most CPUs): it is there for tests and trying, not speed.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16-autocast":
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def peak_memory_bytes(device: str | torch.device) -> int:
    """Peak memory of this process so far: `torch.cuda.max_memory_allocated` on a CUDA device,
    else the peak resident set size (getrusage; 0 where the platform has none)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes, Linux: KiB

