"""Measured compute: a node's seconds of forward+backward compute per microbatch of its stage.

Owns `ComputeMeter`, which the node's torch thread feeds with the wall time of every microbatch
job it runs (`gwtf.runtime.drive.Host.compute`), and `MICROBATCH_KINDS`, what one microbatch costs
on each kind of stage:
- a relay (stage >= 1): its `forward` + its `backward`;
- a data holder (stage 0): the embedding (`embed`), the head's forward + loss + backward (`loss`)
  and the embedding's backward (`embed_backward`): everything it computes for one microbatch.

Per kind, an exponential moving average (weight `alpha` for a new job, `ALPHA`) over the jobs
after the first `warmup` of that kind (torch's first calls allocate, tune and are several times
slower), started as the plain mean of the jobs so far (weight max(alpha, 1/n) for the n-th). The
estimate is the sum of the kinds' averages; it exists once every kind of the stage has `samples`
counted jobs, so the first one is not one job's jitter.
A meter keeps the estimate of one stage: a node that moves to another stage starts afresh.
The core decides whether a new estimate is worth advertising (`NodeCore.on_compute_measured`).

Pure Python (no torch, no clock): the caller measures.
"""

from __future__ import annotations

MICROBATCH_KINDS: dict[bool, tuple[str, ...]] = {
    True: ("embed", "loss", "embed_backward"),  # a data holder (stage 0)
    False: ("forward", "backward"),  # a relay
}
"""Compute kinds whose times make up one microbatch, keyed by "is a data holder"."""

WARMUP_JOBS = 3
"""Jobs of each kind not counted (the first calls of a fresh torch module are slow)."""

SAMPLES = 3
"""Counted jobs of each kind before the first estimate (their mean)."""

ALPHA = 0.1
"""Weight of a new job in a kind's average: about the last 20 jobs count, so the estimate moves
with a real change (a throttled GPU, a busier machine) within a few iterations, while the
jitter of single jobs (tens of percent on a shared machine) mostly averages out."""


def microbatch_kinds(stage: int) -> tuple[str, ...]:
    """The compute kinds of one microbatch on `stage`."""
    return MICROBATCH_KINDS[stage == 0]


class ComputeMeter:
    """Moving averages of one stage's microbatch job times (see the module docstring)."""

    def __init__(self, alpha: float = ALPHA, warmup: int = WARMUP_JOBS, samples: int = SAMPLES) -> None:
        if not 0.0 < alpha <= 1.0 or samples < 1:
            raise ValueError(f"alpha {alpha} not in (0, 1] or samples {samples} < 1")
        self.alpha = alpha
        self.warmup = warmup
        self.samples = samples
        self.stage = -1
        self._seen: dict[str, int] = {}
        self._avg: dict[str, float] = {}

    def add(self, stage: int, kind: str, seconds: float) -> None:
        """One finished job of `kind` on `stage` took `seconds` (kinds of no microbatch are ignored)."""
        if kind not in microbatch_kinds(stage):
            return
        if stage != self.stage:
            self.stage, self._seen, self._avg = stage, {}, {}
        n = self._seen.get(kind, 0) + 1
        self._seen[kind] = n
        if n <= self.warmup:
            return
        old = self._avg.get(kind, 0.0)
        self._avg[kind] = old + max(self.alpha, 1.0 / (n - self.warmup)) * (seconds - old)

    def per_microbatch_s(self, stage: int) -> float | None:
        """Seconds of compute per microbatch of `stage`, or None before every kind has its samples."""
        if stage != self.stage:
            return None
        kinds = microbatch_kinds(stage)
        if any(self._seen.get(k, 0) < self.warmup + self.samples for k in kinds):
            return None
        return sum(self._avg[k] for k in kinds)
