"""Validation loss of a swarm's model, computed by the launcher from the stages' checkpoints.

Owns `CheckpointValidation`: called with a checkpoint version V, it reads every stage's blob of
V (`runtime.checkpoints`, verified; DIR/checkpoints, else a node's own DIR/nodes/*/checkpoints),
loads the weights into freshly built stage modules and returns `model.trainer.evaluate` over the
same fixed validation microbatches `gwtf train --local` uses (`train.eval_microbatches`), so a
swarm's `val_loss` and a local run's are the same number for the same weights. The data set and
the stage modules are built once, at the first call (the launcher then holds one CPU copy of the
model). None when a stage's blob of V is missing or unreadable (pruned, not written: a version
that is not a multiple of `protocol.checkpoint_every`).

Torch runs here on the launcher's thread, one torch thread: the nodes on the same machine keep
the cores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from gwtf.config import Config
from gwtf.model.data import load_dataset
from gwtf.model.presets import model_spec
from gwtf.model.stage import build_stage
from gwtf.model.trainer import evaluate
from gwtf.runtime import checkpoints

__all__ = ["CheckpointValidation"]

log = logging.getLogger(__name__)


class CheckpointValidation:
    """`validation(version) -> float | None` for the run in `out_dir` (see the module docstring)."""

    def __init__(self, cfg: Config, out_dir: Path, say: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.say = say
        self._stages: list[torch.nn.Module] | None = None
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _build(self) -> list[torch.nn.Module]:
        if self._stages is None:
            torch.set_num_threads(1)
            cfg = self.cfg
            kwargs = {"say": self.say} if self.say is not None else {}
            dataset = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders,
                                   microbatches=cfg.train.microbatches, **kwargs)
            self._batches = dataset.val_microbatches(cfg.train.eval_microbatches)
            spec = model_spec(cfg.model, dataset.vocab_size)
            self._stages = [build_stage(spec, k, cfg.model.stages, cfg.train.seed)
                            for k in range(cfg.model.stages)]
        return self._stages

    def _blob(self, stage: int, version: int) -> bytes | None:
        roots = [self.out_dir / checkpoints.CHECKPOINTS_DIR,
                 *sorted(self.out_dir.glob(f"nodes/*/{checkpoints.CHECKPOINTS_DIR}"))]
        for root in roots:
            try:
                return checkpoints.read_version(root, stage, version)
            except (OSError, checkpoints.CheckpointError):
                continue
        return None

    def __call__(self, version: int) -> float | None:
        stages = self._build()
        for k, module in enumerate(stages):
            blob = self._blob(k, version)
            if blob is None:
                log.info("no validation at version %d: stage %d has no readable checkpoint", version, k)
                return None
            tensors = st_load(blob)
            module.load_state_dict({name[2:]: t for name, t in tensors.items() if name.startswith("w.")}, strict=True)
        return evaluate(stages, self._batches)
