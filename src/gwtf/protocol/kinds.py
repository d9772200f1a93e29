"""The closed vocabularies the core and its drivers share: compute kinds (and record names).

Owns `ComputeKind`, the `kind` of every `messages.Compute` effect: what a driver runs for it
(docs/protocol.md, the driver contract). `enum.StrEnum`, so each member is its string: logs,
records and fault points keep the same names, and a plain string compares equal to it.

A leaf module (imports nothing of gwtf). Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class ComputeKind(StrEnum):
    """One stage computation a `Compute` effect asks the driver to run."""

    EMBED = "embed"  # data holder: embedding forward of one microbatch
    FORWARD = "forward"  # a relay's stage forward
    LOSS = "loss"  # data holder: head forward + backward, the gradient w.r.t. the returned activation
    BACKWARD = "backward"  # a relay's backward: accumulates the stage's parameter gradients
    EMBED_BACKWARD = "embed_backward"  # data holder: the embedding's backward
    EXPORT_GRAD = "export_grad"  # the accumulated gradient -> a key
    RESET_GRAD = "reset_grad"  # discard the accumulated gradients
    REDUCE = "reduce"  # sum the input gradients in the given order, divide by `count`
    STEP = "step"  # optimizer step on the reduced gradient
    EXPORT_STATE = "export_state"  # weights + optimizer state -> a key (a joiner's transfer)
    IMPORT_STATE = "import_state"  # ... and back from a key
    LOAD_CHECKPOINT = "load_checkpoint"  # this host's checkpoint copy
    EXPORT_CHECKPOINT = "export_checkpoint"  # a replica: the checkpoint it just wrote -> a "ckpt" key
    STORE_CHECKPOINT = "store_checkpoint"  # a data holder: keep a received "ckpt" key on disk
    READ_CHECKPOINT = "read_checkpoint"  # a data holder: its copy of a stage's checkpoint -> a "ckpt" key


DISK_KINDS = frozenset({ComputeKind.LOAD_CHECKPOINT, ComputeKind.READ_CHECKPOINT, ComputeKind.STORE_CHECKPOINT})
"""Computes that read or write a checkpoint (the simulator charges their bytes at disk bandwidth)."""
