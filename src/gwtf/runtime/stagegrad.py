"""Stage gradients on the wire (`wire.stage_gradients`), with error feedback: the torch thread's side.

Owns `StageGradCodec`, one per node (`drive.Host`): what a replica sends of its gradient in the
within-stage reduction (gather's whole gradient, or the butterfly's parts) and what an owner
sends of the reduced mean, in the format `wire.stage_gradients` (fp32 / bf16 / fp16 / int8
blockwise, `gwtf.model.wire`), and the compression residuals kept between iterations.

- A contributor sends Q(g + r), the quantised sum of its accumulated gradient g and its residual
  r; its new residual is (g + r) - deq(Q(g + r)). A redo round re-exports from the same r, so a
  round that is abandoned changes nothing: the residual of the round that stepped is kept
  (`stepped`).
- An owner (gather's reducer, a butterfly part's owner) sends Q(m + r') of the reduced mean m
  with its own residual r' for that part; it applies deq(Q(m + r')) itself, and every other
  replica applies the same decoded bits: replicas stay bit-identical.
- Residuals are not part of a stage's state: a joiner, a rollback or a restored checkpoint
  starts them at zero (`reset`), and a part whose size changed (other replicas, other parts)
  starts its owner's residual at zero.
- fp32: nothing is encoded, no residual (today's exact path).

Must not import asyncio or socket.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gwtf.model import wire

__all__ = ["StageGradCodec"]

Round = tuple[int, int]  # (iteration, round)


class StageGradCodec:
    """Encodes a node's stage-gradient parts and keeps its error-feedback residuals (module docstring)."""

    def __init__(self, fmt: str, block_values: int, feedback: bool) -> None:
        self.fmt, self.block_values, self.feedback = fmt, block_values, feedback
        self.residual: Tensor | None = None  # this replica's contribution residual (flat)
        self.owned: dict[tuple[int, int], Tensor] = {}  # (part, numel) -> the owner's residual of it
        self._pending: dict[Round, Tensor] = {}  # contribution residual if this round steps
        self._pending_owned: dict[Round, dict[tuple[int, int], Tensor]] = {}

    @property
    def lossy(self) -> bool:
        return self.fmt != "fp32"

    def reset(self) -> None:
        """A new state (joined, rolled back, restored, moved stage): no residual survives it."""
        self.residual = None
        self.owned.clear()
        self._pending.clear()
        self._pending_owned.clear()

    def _code(self, x: Tensor) -> tuple[Tensor, list[np.ndarray]]:
        """(decoded value on x's device, wire arrays) of `x` in the format."""
        arrays = wire.encode(x.detach().float().cpu().contiguous().numpy(), self.fmt, self.block_values)
        dec = torch.from_numpy(wire.decode(arrays, self.block_values)).to(x.device, x.dtype)
        return dec, arrays

    def export(self, flat: Tensor, parts: int, iteration: int, rnd: int) -> list[tuple[Tensor, list[np.ndarray]]]:
        """A contributor's gradient `flat` as `parts` contiguous parts: (decoded, wire arrays) each."""
        e = flat
        if self.feedback and self.residual is not None and self.residual.shape == flat.shape:
            e = flat + self.residual
        coded = [self._code(p) for p in (torch.tensor_split(e, parts) if parts > 1 else (e,))]
        if self.feedback:
            self._pending[(iteration, rnd)] = e - torch.cat([d for d, _ in coded])
        return coded

    def reduced(self, mean: Tensor, part: int, iteration: int, rnd: int) -> tuple[Tensor, list[np.ndarray]]:
        """An owner's reduced part `part` of the mean: (decoded, wire arrays)."""
        slot = (part, int(mean.numel()))
        r = self.owned.get(slot) if self.feedback else None
        e = mean + r if r is not None and r.shape == mean.shape else mean
        dec, arrays = self._code(e)
        if self.feedback:
            self._pending_owned.setdefault((iteration, rnd), {})[slot] = e - dec
        return dec, arrays

    def stepped(self, iteration: int, rnd: int) -> None:
        """The step of (iteration, round) applied: its residuals become the ones to add back next."""
        mine = self._pending.get((iteration, rnd))
        if mine is not None:
            self.residual = mine
        self.owned = self._pending_owned.get((iteration, rnd), {})  # parts owned in another round start again
        for table in (self._pending, self._pending_owned):
            for k in [k for k in table if k[0] <= iteration]:
                del table[k]
