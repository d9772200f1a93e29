"""The stage worker: real tensors for one node's stage, run on the node's single torch thread.

Owns the stage module and its `StageOptimizer` (reused from the reference trainer, so a
churn-free swarm takes the very steps of `gwtf train --local`), the tensor store (activations and
gradients named by the protocol's tensor keys), the autograd graphs kept between a microbatch's
forward and its backward, and the serialisation of stage state for joiners (safetensors bytes:
weights + AdamW state; never pickle).

Every method is synchronous and must be called from ONE thread (the node's single-thread
executor), because autograd graphs and `.grad` accumulation are not thread-safe. The event loop
only reads finished tensors out of the store (`to_numpy`) to attach them to outgoing frames.

Semantics mirror `gwtf.model.stage.stage_forward_backward_reference`: activations are detached
and re-leafed at every stage boundary; the data holder scales its loss by 1/(D*M) (D*M =
`train.data_holders * train.microbatches`), so relays accumulate already count-weighted
gradients and the aggregated gradient of a stage is their sum rescaled to the microbatches that
contributed (`reduce`, the reference trainer's `aggregate_stage_grads` rule; one replica reduces
and sends the result to the others, so every replica steps with identical bits).

Precision (`train.precision`, `gwtf.model.device`): forward passes may run in bfloat16 autocast;
weights, gradients and AdamW state stay float32, and every tensor leaves for the wire as float32
(`tensor_to_numpy`), so the wire format does not depend on the compute precision or device.

Must not import asyncio or socket.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from gwtf.config import Config
from gwtf.model.data import TokenDataset
from gwtf.model.device import compute_autocast, peak_memory_bytes
from gwtf.model.presets import ModelSpec
from gwtf.model.stage import FirstStage, build_stage
from gwtf.model.trainer import StageOptimizer
from gwtf.runtime.codec import check_finite

TensorKey = Hashable


class GradientRejected(ValueError):
    """A received gradient is not finite (NaN/Inf); `reason` says which."""


@dataclass(slots=True)
class _Saved:
    """What a microbatch's backward needs: the re-leafed input and the graph's output."""

    leaf: Tensor | None  # None at the data holder's embedding (tokens are not differentiable)
    output: Tensor
    targets: Tensor | None = None  # data holders: the microbatch's targets, for the loss
    iteration: int = -1  # for dropping graphs of finished iterations


class StageWorker:
    """Holds one stage's module, optimizer, graphs and tensors; runs its compute jobs."""

    def __init__(
        self, cfg: Config, spec: ModelSpec, stage: int, device: str = "cpu",
        dataset: TokenDataset | None = None, shard: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.stage = stage
        self.device = torch.device(device)
        self.dataset = dataset
        self.shard = shard
        self.module: nn.Module = build_stage(spec, stage, cfg.model.stages, cfg.train.seed, device=self.device)
        self.optimizer = StageOptimizer(self.module, cfg.train)
        self.planned = cfg.train.data_holders * cfg.train.microbatches
        self.store: dict[TensorKey, Tensor] = {}
        self._saved: dict[Hashable, _Saved] = {}
        self.microbatches_accumulated = 0
        self.last_grad_norm: float | None = None  # pre-clip norm of the last step's gradient

    # -- tensor store -------------------------------------------------------------------------

    def put(self, key: TensorKey, array: np.ndarray, cast: bool = False) -> None:
        """Store a received tensor (a wire array) under `key`; `cast`: in torch's default float
        dtype (a decoded bf16/fp16/int8 wire tensor arrives as float32)."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        self.store[key] = t.to(self.device, torch.get_default_dtype()) if cast else t.to(self.device)

    def to_numpy(self, key: TensorKey) -> np.ndarray:
        """The stored tensor `key` as a contiguous CPU array (for an outgoing frame)."""
        return tensor_to_numpy(self.store[key])

    def free(self, keys: Sequence[TensorKey]) -> None:
        for key in keys:
            self.store.pop(key, None)
            self._saved.pop(key, None)

    def drop_graphs_before(self, iteration: int) -> None:
        """Forget autograd graphs of iterations <= `iteration` (microbatches rerouted elsewhere)."""
        for key in [k for k, s in self._saved.items() if 0 <= s.iteration <= iteration]:
            del self._saved[key]

    def clear(self) -> None:
        """Drop every tensor and graph (iteration end after the step)."""
        self.store.clear()
        self._saved.clear()

    # -- compute jobs -------------------------------------------------------------------------

    def embed(self, mb: Hashable, iteration: int, index: int, out_key: TensorKey, shard: int | None = None) -> int:
        """Data holder: tokens of microbatch (shard, iteration, index) -> activation `out_key`;
        `shard` None: this data holder's own (another is a vacant shard it serves too).

        Returns the number of tokens in the microbatch.
        """
        first = self._first()
        shard = self.shard if shard is None else shard
        assert self.dataset is not None and shard is not None, "embed needs a data holder's dataset"
        tokens, targets = self.dataset.microbatch(shard, iteration, index)
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        with self._autocast():
            out = first.embed(tokens)
        self._saved[mb] = _Saved(leaf=None, output=out, targets=targets, iteration=iteration)
        self.store[out_key] = out.detach()
        return int(tokens.numel())

    def forward(self, mb: Hashable, in_key: TensorKey, out_key: TensorKey) -> None:
        """Relay: activation `in_key` -> this stage's blocks -> activation `out_key`."""
        leaf = self.store[in_key].detach().requires_grad_(True)
        with self._autocast():
            out = self.module(leaf)
        it = out_key[2] if isinstance(out_key, tuple) and len(out_key) > 2 and isinstance(out_key[2], int) else -1
        self._saved[mb] = _Saved(leaf=leaf, output=out, iteration=it)
        self.store[out_key] = out.detach()

    def loss(self, mb: Hashable, in_key: TensorKey, grad_key: TensorKey) -> float:
        """Data holder: head + loss (scaled 1/(D*M)) + backward to the last relay's activation.

        Returns the unscaled loss; the gradient w.r.t. the received activation goes to `grad_key`.
        """
        first = self._first()
        saved = self._saved[mb]
        assert saved.targets is not None, f"loss of {mb!r} without its embedding"
        final = self.store[in_key].detach().requires_grad_(True)
        with self._autocast():
            loss = first.head_loss(final, saved.targets)
        (loss * (1.0 / self.planned)).backward()
        assert final.grad is not None
        self.store[grad_key] = final.grad
        return float(loss.detach())

    def backward(self, mb: Hashable, grad_key: TensorKey, out_grad_key: TensorKey | None) -> None:
        """Backward through the saved graph of `mb` with the gradient `grad_key`.

        Relays put the gradient w.r.t. their input under `out_grad_key`; a data holder's
        embedding backward (`out_grad_key` None) ends the microbatch.
        """
        grad = self.store[grad_key]
        reason = check_finite([tensor_to_numpy(grad)])
        if reason is not None:
            raise GradientRejected(f"gradient {grad_key!r}: {reason}")
        saved = self._saved.pop(mb)
        saved.output.backward(grad)
        self.microbatches_accumulated += 1
        if out_grad_key is not None:
            assert saved.leaf is not None and saved.leaf.grad is not None
            self.store[out_grad_key] = saved.leaf.grad

    # -- aggregation and step -----------------------------------------------------------------

    def grads_flat(self) -> Tensor:
        """This replica's accumulated gradient as one flat float32 tensor (zeros if none)."""
        return torch.cat([g.reshape(-1) for g in self.optimizer.current_grads()]).detach().clone()

    def unflatten(self, flat: Tensor) -> list[Tensor]:
        out, offset = [], 0
        for p in self.optimizer.params:
            n = p.numel()
            out.append(flat[offset:offset + n].view_as(p).to(p.dtype))
            offset += n
        if offset != flat.numel():
            raise GradientRejected(f"gradient of {flat.numel()} values for a stage of {offset} parameters")
        return out

    def reduce(self, flats: Sequence[Tensor], count: int) -> Tensor:
        """The stage's gradient from the contributors' flat gradients (in the given order).

        Each input is a sum of per-microbatch gradients pre-scaled by 1/(D*M), so the mean over
        the `count` microbatches that contributed is sum * (D*M)/count: exactly
        `aggregate_stage_grads(..., planned_count=D*M)` of the reference trainer.
        """
        for i, flat in enumerate(flats):
            reason = check_finite([tensor_to_numpy(flat)])
            if reason is not None:
                raise GradientRejected(f"gradient {i} of the reduction: {reason}")
        if not flats or count <= 0:
            # nothing of this iteration's batch reached this stage alive (e.g. the data holder that
            # trained it and the leader died together while the only other one had just joined):
            # the protocol still commits and steps every replica alike, on a zero gradient
            return torch.zeros_like(self.grads_flat())
        out = flats[0].detach().clone()
        for flat in flats[1:]:
            out.add_(flat)
        if count != self.planned:
            out.mul_(self.planned / count)
        return out

    def apply_step(self, iteration: int, flat: Tensor) -> str:
        """One optimizer step with the reduced flat gradient; returns the new weights' hash."""
        reason = check_finite([tensor_to_numpy(flat)])
        if reason is not None:
            raise GradientRejected(f"reduced gradient: {reason}")
        self.last_grad_norm = float(self.optimizer.step(iteration, self.unflatten(flat)))
        self.microbatches_accumulated = 0
        return self.weights_hash()

    def step(self, iteration: int, replicas: Sequence[tuple[str, Tensor, int]]) -> str:
        """Reduce (replica id, flat gradient, microbatch count) in sorted id order, then step.

        Every replica passing the same list gets identical bits. Returns the new weights' hash.
        """
        ordered = sorted(replicas, key=lambda r: r[0])
        return self.apply_step(iteration, self.reduce([f for _, f, _ in ordered], sum(c for _, _, c in ordered)))

    def reset_initial(self) -> None:
        """Back to the seeded initial weights and a fresh optimizer (checkpoint version 0)."""
        fresh = build_stage(self.spec, self.stage, self.cfg.model.stages, self.cfg.train.seed, device=self.device)
        self.module.load_state_dict(fresh.state_dict(), strict=True)
        self.optimizer = StageOptimizer(self.module, self.cfg.train)
        self._saved.clear()
        self.microbatches_accumulated = 0

    def zero_grads(self) -> None:
        self.optimizer.optimizer.zero_grad(set_to_none=True)
        self.microbatches_accumulated = 0

    # -- state for joiners --------------------------------------------------------------------

    def state_blob(self) -> np.ndarray:
        """Weights + AdamW state as safetensors bytes (a uint8 array for the wire)."""
        tensors: dict[str, Tensor] = {f"w.{k}": v.detach().cpu().contiguous() for k, v in
                                      self.module.state_dict().items()}
        tensors.update({k: v.detach().cpu().contiguous() for k, v in self.optimizer.state_tensors().items()})
        return np.frombuffer(st_save(tensors), dtype=np.uint8)

    def load_state_blob(self, blob: np.ndarray) -> None:
        """Install weights + optimizer state received from a live replica."""
        tensors = st_load(bytes(np.ascontiguousarray(blob, dtype=np.uint8).data))
        weights = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
        self.module.load_state_dict(weights, strict=True)
        self.optimizer.load_state_tensors({k: v.to(self.device) for k, v in tensors.items() if k.startswith("opt.")})

    def weights_hash(self) -> str:
        """sha256 (16 hex digits) of every parameter's bytes in name order: replica identity."""
        h = hashlib.sha256()
        for name, p in self.module.state_dict().items():
            h.update(name.encode())
            h.update(tensor_to_numpy(p).tobytes())
        return h.hexdigest()[:16]

    def _autocast(self) -> AbstractContextManager[None]:
        """The forward passes' precision (`train.precision`); backward runs outside it."""
        return compute_autocast(self.device, self.cfg.train.precision)

    def peak_memory_bytes(self) -> int:
        """This process's peak memory so far (CUDA: allocated on the device; else resident set)."""
        return peak_memory_bytes(self.device)

    def _first(self) -> FirstStage:
        assert isinstance(self.module, FirstStage), "only stage 0 (data holders) embeds and computes loss"
        return self.module


def tensor_to_numpy(t: Tensor) -> np.ndarray:
    """A contiguous CPU numpy view/copy of `t` (bfloat16 is widened to float32)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.cpu().contiguous().numpy()


def describe(value: Any) -> str:
    """Short text for a tensor key in logs."""
    return "/".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
