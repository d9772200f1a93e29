"""Node compute profiles: heterogeneous GPU classes, their speed, memory, and microbatch capacity.

Owns: `ComputeProfile` (peak 16-bit tensor FLOP/s, an assumed MFU, memory), `PROFILES` (named
classes), `DEFAULT_MIX` (a seeded volunteer mix), `NAMED_MIXES` and `resolve_mix` (a scenario's
`nodes.gpu_mix`: a name or explicit (profile, share) pairs), `draw_profile`, and the memory model
that turns a profile and a stage into a capacity in microbatches:

    capacity = clamp(floor((memory - resident state - overhead) / per-microbatch memory), 1, cap_max)

resident state = 16 bytes per parameter of the stage (fp32 weights, grads, AdamW exp_avg and
exp_avg_sq); per-microbatch memory = activations kept for backward. For a transformer block we
use the 16-bit estimate of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", eq. 1): s*b*(34*h + 5*a*s) bytes per layer. Stage 0 keeps the logits and
their gradient (fp32) plus the embedding output. Peak numbers and sources: docs/routing.md.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gwtf.errors import UserError
from gwtf.model.partition import partition_layers
from gwtf.model.presets import ModelSpec

GIB = 1024**3
OVERHEAD_BYTES = 1 * GIB  # CUDA context, allocator slack, framework buffers
DEFAULT_CAP_MAX = 20  # the prototype draws relay capacities from 1..20 (PAPER.md 1.3)


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """One GPU class as a volunteer node brings it."""

    name: str
    peak_flops_per_s: float  # dense 16-bit tensor-core peak (fp32 accumulate where it differs)
    mfu: float  # model FLOPs utilisation assumed for training
    memory_bytes: int

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.mfu


PROFILES: dict[str, ComputeProfile] = {
    # datacenter: NVIDIA A100 40GB, 312 TFLOP/s bf16 dense (A100 datasheet)
    "a100": ComputeProfile("a100", 312e12, 0.40, 40 * GIB),
    # consumer: RTX 4090, 165.2 TFLOP/s fp16 tensor w/ fp32 accumulate, dense (Ada whitepaper)
    "rtx4090": ComputeProfile("rtx4090", 165.2e12, 0.35, 24 * GIB),
    # consumer: RTX 3090, 71 TFLOP/s fp16 tensor w/ fp32 accumulate, dense (Ampere GA102 whitepaper)
    "rtx3090": ComputeProfile("rtx3090", 71e12, 0.35, 24 * GIB),
    # older datacenter: V100 16GB, 125 TFLOP/s fp16 tensor (V100 datasheet)
    "v100": ComputeProfile("v100", 125e12, 0.30, 16 * GIB),
    # older / cloud inference: T4, 65 TFLOP/s fp16 tensor (T4 datasheet)
    "t4": ComputeProfile("t4", 65e12, 0.30, 16 * GIB),
}

# A volunteer swarm: mostly consumer and older cards, some datacenter GPUs.
DEFAULT_MIX: tuple[tuple[str, float], ...] = (
    ("a100", 0.15), ("rtx4090", 0.20), ("rtx3090", 0.25), ("v100", 0.20), ("t4", 0.20),
)

NAMED_MIXES: dict[str, tuple[tuple[str, float], ...]] = {
    "default": DEFAULT_MIX,
    "uniform": (("a100", 1.0),),  # every node the same GPU
    "half-slow": (("a100", 0.5), ("t4", 0.5)),  # "uniform" with half of its GPUs ~6x slower
}


def resolve_mix(mix: str | Sequence[Any], key: str = "gpu_mix") -> tuple[tuple[str, float], ...]:
    """A named mix (`NAMED_MIXES`) or explicit [[profile, share], ...] -> (profile, share) pairs.

    Shares are relative weights (they need not sum to 1). Raises UserError naming `key` for an
    unknown name or profile, a malformed pair, a negative or non-finite share, or no positive share.
    """
    if isinstance(mix, str):
        if mix not in NAMED_MIXES:
            raise UserError(f"{key}: unknown mix {mix!r} (known: {', '.join(NAMED_MIXES)}, or [[profile, share], ...])")
        return NAMED_MIXES[mix]
    out: list[tuple[str, float]] = []
    for i, pair in enumerate(mix):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str) \
            and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)
        if not ok:
            raise UserError(f"{key}[{i}]: expected [profile, share], got {pair!r}")
        name, share = pair[0], float(pair[1])
        if name not in PROFILES:
            raise UserError(f"{key}[{i}]: unknown compute profile {name!r} (known: {', '.join(PROFILES)})")
        if not (math.isfinite(share) and share >= 0):
            raise UserError(f"{key}[{i}]: share must be a finite number >= 0, got {pair[1]!r}")
        out.append((name, share))
    if not any(share > 0 for _, share in out):
        raise UserError(f"{key}: needs at least one profile with a share > 0")
    return tuple(out)


def draw_profile(rng: random.Random, mix: Sequence[tuple[str, float]] = DEFAULT_MIX) -> ComputeProfile:
    """Draw one profile from a weighted mix (seeded)."""
    for name, _ in mix:
        if name not in PROFILES:
            raise UserError(f"unknown compute profile {name!r} (known: {', '.join(PROFILES)})")
    names = [name for name, _ in mix]
    weights = [w for _, w in mix]
    return PROFILES[rng.choices(names, weights=weights, k=1)[0]]


def stage_blocks(spec: ModelSpec, stage: int, stages: int) -> int:
    """Number of transformer blocks stage `stage` holds (0 for stage 0)."""
    return len(partition_layers(spec.n_layer, stages)[stage])


def resident_bytes(spec: ModelSpec, stage: int, stages: int) -> int:
    """Weights + grads + AdamW moments in fp32: 16 bytes per parameter of the stage."""
    return 16 * spec.stage_param_count(stage, stages)


def microbatch_memory_bytes(spec: ModelSpec, stage: int, stages: int, microbatch_size: int) -> int:
    """Activation memory one in-flight microbatch pins on a node of `stage` until its backward."""
    tokens = microbatch_size * spec.seq_len
    boundary = 2 * spec.activation_bytes(microbatch_size)  # received input + sent output (fp32)
    if stage == 0:
        logits = 2 * tokens * spec.vocab_size * 4  # logits and their gradient, fp32
        return logits + boundary
    per_layer = tokens * (34 * spec.d_model + 5 * spec.n_head * spec.seq_len)
    return stage_blocks(spec, stage, stages) * per_layer + boundary


def capacity_microbatches(
    profile: ComputeProfile,
    spec: ModelSpec,
    stage: int,
    stages: int,
    microbatch_size: int,
    cap_max: int = DEFAULT_CAP_MAX,
) -> int:
    """floor((memory - resident - overhead) / per-microbatch memory), clamped to [1, cap_max]."""
    free = profile.memory_bytes - resident_bytes(spec, stage, stages) - OVERHEAD_BYTES
    per_mb = microbatch_memory_bytes(spec, stage, stages, microbatch_size)
    return max(1, min(cap_max, math.floor(free / per_mb)))


def compute_seconds(profile: ComputeProfile, spec: ModelSpec, stage: int, stages: int,
                    microbatch_size: int) -> float:
    """c_i: forward + backward seconds of one microbatch of `stage` on this profile."""
    flops = spec.stage_flops_per_microbatch(stage, stages, microbatch_size)
    return flops / profile.effective_flops_per_s
