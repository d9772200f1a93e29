"""The reference trainer: DESIGN.md section 3 iteration semantics over the stage modules.

Owns: the learning-rate schedule (`lr_at`), gradient aggregation across the replicas of a stage
(`aggregate_stage_grads`), the per-stage optimizer step (`StageOptimizer`: per-stage norm
clipping + AdamW), one local iteration (`train_iteration`), validation loss (`evaluate`), and
the stage/optimizer <-> checkpoint tensor mapping. The distributed runtime reuses the first three
so a churn-free swarm takes the very same steps. `train_local` at the bottom is the run loop of
`gwtf train --local` (outputs, checkpoints, resume); progress display is the command's job.

Iteration t (DESIGN.md section 3): for each data holder d, for each microbatch m, in order:
`dataset.microbatch(d, t, m)` runs embed -> relays -> head_loss with detach/re-leaf at every stage
boundary (`stage_forward_backward_reference`), loss scaled by 1/(D*M); data holders are the
stage-0 replicas, so stage-0 gradients are accumulated per data holder and aggregated with
`aggregate_stage_grads`; every stage then clips its own gradient norm and takes one AdamW step.
With `train.local_rounding` every boundary tensor is rounded as the [wire] formats do, so a
swarm with compressed activations/gradients has a local reference too.
Must not import asyncio, socket or threading.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gwtf.config import Config, TrainConfig, WireConfig, to_dict, write_resolved
from gwtf.errors import UserError
from gwtf.model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from gwtf.model.data import TokenDataset, load_dataset, resolve_source
from gwtf.model.device import compute_autocast, peak_memory_bytes, resolve_device
from gwtf.model.presets import model_spec
from gwtf.model.pretrained import resolve_init
from gwtf.model.stage import FirstStage, build_stage, round_on_wire, stage_forward_backward_reference

__all__ = [
    "IterationStats",
    "LocalRunResult",
    "StageOptimizer",
    "aggregate_stage_grads",
    "clip_grads_by_norm",
    "evaluate",
    "lr_at",
    "train_iteration",
    "train_local",
]


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Learning rate of iteration `iteration` (0-based): linear warmup, then cosine to min_lr.

    Warmup: lr * (t + 1) / warmup for t < warmup. Then cosine from lr at t = warmup to min_lr at
    t = iterations - 1; min_lr afterwards (a run extended past its schedule keeps min_lr).
    """
    if iteration < cfg.warmup_iterations:
        return cfg.lr * (iteration + 1) / cfg.warmup_iterations
    decay_span = cfg.iterations - 1 - cfg.warmup_iterations
    if decay_span <= 0:
        return cfg.lr  # no room to decay
    progress = min(1.0, (iteration - cfg.warmup_iterations) / decay_span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def aggregate_stage_grads(
    grads_per_replica: Sequence[Sequence[Tensor]], counts: Sequence[int], planned_count: int | None = None
) -> list[Tensor]:
    """Combine the replicas' gradients of one stage into the gradient every replica steps with.

    Each replica accumulated the gradients of its `counts[r]` microbatches with every loss
    scaled by 1/planned_count (planned_count = D*M, known before the iteration). Such a gradient
    is already count-weighted, so the count-weighted mean over replicas is their plain sum
    (in replica order; with one replica it is returned unchanged, bit for bit). When microbatches
    were dropped (sum(counts) < planned_count, e.g. a data holder crashed), the sum is rescaled by
    planned/actual so the step stays a mean over the microbatches that did contribute.
    Replicas with count 0 are ignored.

    Args:
        grads_per_replica: one list of tensors per replica, same shapes in the same order.
        counts: microbatches each replica contributed.
        planned_count: D*M; None means "no rescaling".

    Returns:
        New tensors (the inputs are not modified).
    """
    if len(grads_per_replica) != len(counts):
        raise ValueError("one count per replica")
    live = [g for g, c in zip(grads_per_replica, counts, strict=True) if c > 0]
    if not live:
        raise ValueError("no replica contributed a microbatch")
    out = [t.clone() for t in live[0]]
    for grads in live[1:]:
        if len(grads) != len(out):
            raise ValueError("replicas disagree on the number of gradient tensors")
        for acc, g in zip(out, grads, strict=True):
            acc.add_(g)
    total = sum(counts)
    if planned_count is not None and total != planned_count:
        for acc in out:
            acc.mul_(planned_count / total)
    return out


def clip_grads_by_norm(grads: Sequence[Tensor], max_norm: float) -> float:
    """Scale `grads` in place so their joint L2 norm is at most `max_norm` (0 = off).

    Per-stage, not global: a replica only sees its own stage (docs/training.md), and the local
    trainer does the same so local == distributed. Returns the norm before clipping.
    """
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return float(norm)


class StageOptimizer:
    """AdamW for one stage: decay on matrices (ndim >= 2), none on biases/norms/gains.

    `step(iteration, grads)` installs the aggregated gradient, clips it by norm, sets the lr of
    `lr_at(iteration)`, steps and clears the gradients: exactly one call per stage per iteration.
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False,
        )

    def current_grads(self) -> list[Tensor]:
        """The accumulated `.grad` of every parameter (zeros where none), in `names` order."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def step(self, iteration: int, grads: Sequence[Tensor] | None = None) -> float:
        """Clip, set lr, AdamW step, zero grads. Returns the pre-clip gradient norm."""
        if grads is not None:
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
        grads_now = self.current_grads()
        for p, g in zip(self.params, grads_now, strict=True):
            p.grad = g
        norm = clip_grads_by_norm(grads_now, self.cfg.grad_clip)
        lr = lr_at(iteration, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_tensors(self) -> dict[str, Tensor]:
        """AdamW state as flat named tensors (`opt.<param>.<exp_avg|exp_avg_sq|step>`)."""
        out: dict[str, Tensor] = {}
        for name, p in zip(self.names, self.params, strict=True):
            for key, value in self.optimizer.state.get(p, {}).items():
                t = value if isinstance(value, Tensor) else torch.tensor(float(value))
                out[f"opt.{name}.{key}"] = t
        return out

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Inverse of `state_tensors` (missing entries = a parameter that never stepped)."""
        for name, p in zip(self.names, self.params, strict=True):
            prefix = f"opt.{name}."
            # on the parameter's device; AdamW's step counter stays on the CPU, where it keeps its own
            state = {k[len(prefix):]: v.to("cpu" if k.endswith(".step") else p.device, copy=True)
                     for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                self.optimizer.state[p] = state


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What one iteration reports: mean microbatch loss, tokens, per-stage pre-clip grad norms."""

    loss: float
    tokens: int
    grad_norms: list[float]
    lr: float


class StageGradRounding:
    """`train.local_rounding` of the within-stage reduction (`wire.stage_gradients`): what a swarm
    does to a stage gradient, emulated in one process with its error feedback. Each data holder
    (a stage-0 replica) sends its gradient plus its residual rounded; a relay stage is one replica;
    the reduced mean is rounded again with the stage's owner residual (`runtime.stagegrad`
    does the same with torch tensors on a node). The residuals live as long as the object: one
    per `train_local` run (a resumed run starts them at zero, as a swarm's joiner does)."""

    def __init__(self, fmt: str, block_values: int, feedback: bool) -> None:
        self.fmt, self.block_values, self.feedback = fmt, block_values, feedback
        self.residuals: dict[tuple[int, int], Tensor] = {}  # (stage, replica or -1 for the mean) -> flat

    def round(self, stage: int, replica: int, grads: Sequence[Tensor]) -> list[Tensor]:
        flat = torch.cat([g.reshape(-1) for g in grads])
        r = self.residuals.get((stage, replica)) if self.feedback else None
        e = flat + r if r is not None else flat
        q = round_on_wire(e, self.fmt, self.block_values)
        if self.feedback:
            self.residuals[(stage, replica)] = e - q
        out, offset = [], 0
        for g in grads:
            out.append(q[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return out


StageGrads = list[list[Tensor]]  # per stage: the reduced gradient every replica steps with


def train_iteration(
    stages: Sequence[nn.Module], optimizers: Sequence[StageOptimizer], dataset: TokenDataset,
    iteration: int, cfg: TrainConfig, wire: WireConfig | None = None,
    grad_rounding: StageGradRounding | None = None,
) -> IterationStats:
    """One synchronous iteration (DESIGN.md section 3) in one process; `wire`: round the stage
    boundaries as those wire formats do (`train.local_rounding`), None: exact; `grad_rounding`:
    round the stage gradients as `wire.stage_gradients` does (None: exact)."""
    stats, grads = iteration_grads(stages, optimizers, dataset, iteration, cfg, wire, grad_rounding)
    norms = apply_steps(optimizers, iteration, grads)
    return replace(stats, grad_norms=norms)


def apply_steps(optimizers: Sequence[StageOptimizer], iteration: int, grads: StageGrads) -> list[float]:
    """Every stage's step of `iteration` with its reduced gradient; the pre-clip norms."""
    return [opt.step(iteration, g) for opt, g in zip(optimizers, grads, strict=True)]


def take_steps(optimizers: Sequence[StageOptimizer], t: int, grads: StageGrads, pending: StageGrads | None,
               delay: int) -> StageGrads | None:
    """The steps iteration t takes once its reduced gradients `grads` are known
    (`train.update_delay`, docs/protocol.md): with delay 0 step t now; with 1 step t-1 with
    `pending` (none in the first iteration) and return `grads`, step t's, still to come."""
    if not delay:
        apply_steps(optimizers, t, grads)
        return None
    if pending is not None:
        apply_steps(optimizers, t - 1, pending)
    return grads


def grad_norm(grads: Sequence[Tensor]) -> float:
    """The joint L2 norm of `grads` (what `clip_grads_by_norm` returns, without clipping)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0


def iteration_grads(
    stages: Sequence[nn.Module], optimizers: Sequence[StageOptimizer], dataset: TokenDataset,
    iteration: int, cfg: TrainConfig, wire: WireConfig | None = None,
    grad_rounding: StageGradRounding | None = None,
) -> tuple[IterationStats, StageGrads]:
    """The passes of one iteration and each stage's reduced gradient, no step taken (the
    accumulated gradients are left zeroed); the stats' `grad_norms` are those gradients' norms
    before clipping (what the step will report)."""
    formats = None if wire is None else (wire.activations, wire.gradients, wire.block_values)
    d_count, m_count = cfg.data_holders, cfg.microbatches
    planned = d_count * m_count
    losses: list[float] = []
    tokens = 0
    stage0_grads: list[list[Tensor]] = []
    device = _device_of(stages[0])
    for d in range(d_count):
        for m in range(m_count):
            x, y = dataset.microbatch(d, iteration, m)
            x, y = x.to(device), y.to(device)
            loss = stage_forward_backward_reference(stages, x, y, loss_scale=1.0 / planned,
                                                    precision=cfg.precision, wire_formats=formats)
            losses.append(float(loss))
            tokens += x.numel()
        stage0_grads.append([g.clone() for g in optimizers[0].current_grads()])
        optimizers[0].optimizer.zero_grad(set_to_none=True)  # next data holder = next replica
    gr = grad_rounding
    if gr is not None:
        stage0_grads = [gr.round(0, d, g) for d, g in enumerate(stage0_grads)]
    mean0 = aggregate_stage_grads(stage0_grads, [m_count] * d_count, planned)
    grads: StageGrads = [mean0 if gr is None else gr.round(0, -1, mean0)]
    for k, opt in enumerate(optimizers[1:], start=1):
        mine = [g.clone() for g in opt.current_grads()]
        opt.optimizer.zero_grad(set_to_none=True)
        if gr is not None:
            mine = gr.round(k, 0, mine)
        relay = aggregate_stage_grads([mine], [planned], planned)
        grads.append(relay if gr is None else gr.round(k, -1, relay))
    stats = IterationStats(loss=sum(losses) / len(losses), tokens=tokens, grad_norms=[grad_norm(g) for g in grads],
                           lr=lr_at(iteration, cfg))
    return stats, grads


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def evaluate(
    stages: Sequence[nn.Module], batches: Sequence[tuple[Tensor, Tensor]], precision: str = "fp32"
) -> float | None:
    """Mean loss over fixed validation microbatches (None when there are none), computed in
    `precision` (`train.precision`) on the stages' device."""
    if not batches:
        return None
    first = stages[0]
    assert isinstance(first, FirstStage)
    was_training = [s.training for s in stages]
    for s in stages:
        s.eval()
    total = 0.0
    device = _device_of(first)
    for x, y in batches:
        with compute_autocast(device, precision):
            h = first.embed(x.to(device))
            for relay in stages[1:]:
                h = relay(h)
            total += float(first.head_loss(h, y.to(device)))
    for s, mode in zip(stages, was_training, strict=True):
        s.train(mode)
    return total / len(batches)


# ------------------------------------------------------------------------------------------
# The local run: outputs, checkpoints, resume
# ------------------------------------------------------------------------------------------

# Keys that may change between a checkpoint and its resumption (they do not alter the math of the
# iterations already run, or only extend the schedule).
_RESUMABLE_KEYS = {
    "train.iterations", "train.time_limit_s", "train.checkpoint_every", "train.torch_threads",
    "train.eval_every", "data.cache_dir", "train.device",
}
OnIteration = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class LocalRunResult:
    """What `train_local` did: metrics of every iteration so far (resumed ones included)."""

    metrics: list[dict[str, Any]]
    completed: int  # iterations completed in total
    stopped_early: bool  # time limit or stop_after
    dataset: TokenDataset


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(_flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def _check_resumable(saved: dict[str, Any], cfg: Config) -> None:
    now = _flatten(to_dict(cfg))
    old = {**_flatten(to_dict(Config())), **_flatten(saved)}
    for key in sorted(set(now) | set(old)):  # (a key the checkpoint predates counts as its default)
        if key not in _RESUMABLE_KEYS and now.get(key) != old.get(key):
            raise UserError(
                f"cannot resume: checkpoint was written with {key}={old.get(key)!r}, config now has "
                f"{now.get(key)!r}"
            )


def _read_metrics(path: Path, before: int) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    # A stop-time evaluation is not part of the run's cadence: drop it so resumed == uninterrupted.
    return [{k: v for k, v in r.items() if k != "val_loss_at_stop"} for r in rows if int(r["iteration"]) < before]


def _save(
    out_dir: Path, completed: int, stages: Sequence[nn.Module], optimizers: Sequence[StageOptimizer],
    cfg: Config, elapsed_s: float, metrics: list[dict[str, Any]], pending: StageGrads | None = None,
) -> None:
    """`pending` (train.update_delay 1): the reduced gradients whose step is still to come,
    kept as `pending.<n>` tensors so that a resumed run takes the same steps."""
    tensors = [  # .cpu() is the tensor itself on the CPU (no copy)
        {**{f"param.{k}": v.cpu() for k, v in s.state_dict().items()},
         **{k: v.cpu() for k, v in o.state_tensors().items()},
         **({f"pending.{n}": g.cpu() for n, g in enumerate(pending[k])} if pending is not None else {})}
        for k, (s, o) in enumerate(zip(stages, optimizers, strict=True))
    ]
    meta = {"config": to_dict(cfg), "elapsed_s": elapsed_s}
    save_checkpoint(out_dir / "checkpoint", completed, tensors, {"torch_rng": torch.get_rng_state()}, meta)
    if metrics:
        from gwtf.model.plots import plot_loss  # lazy: matplotlib costs ~1 s at every node's start

        plot_loss(metrics, out_dir / "loss.png", title=f"{cfg.model.family}-{cfg.model.preset} on {cfg.data.source}")


def _open_checkpoint(out_dir: Path, cfg: Config) -> Checkpoint:
    """Load, verify and check compatibility before any data or model work (fail fast)."""
    path = out_dir / "checkpoint"
    ckpt = load_checkpoint(path)
    if len(ckpt.stages) != cfg.model.stages or not isinstance(ckpt.meta.get("config"), dict):
        raise UserError(f"corrupt checkpoint: {path} (stage count or config missing)")
    _check_resumable(ckpt.meta["config"], cfg)
    return ckpt


def _restore(
    ckpt: Checkpoint, path: Path, stages: Sequence[nn.Module], optimizers: Sequence[StageOptimizer]
) -> tuple[int, float]:
    for s, o, tensors in zip(stages, optimizers, ckpt.stages, strict=True):
        params = {k[len("param."):]: v for k, v in tensors.items() if k.startswith("param.")}
        try:
            s.load_state_dict(params, strict=True)
        except RuntimeError as exc:
            raise UserError(f"corrupt checkpoint: {path} ({str(exc).splitlines()[0]})") from None
        o.load_state_tensors(tensors)
    torch.set_rng_state(ckpt.extra["torch_rng"])
    return ckpt.iteration, float(ckpt.meta.get("elapsed_s", 0.0))


def ckpt_pending(ckpt: Checkpoint, device: str) -> StageGrads | None:
    """The pending step's gradients a checkpoint holds (`_save`), on `device`; None without one."""
    if not any(k.startswith("pending.") for k in ckpt.stages[0]):
        return None
    return [[t[f"pending.{n}"].to(device) for n in range(sum(1 for k in t if k.startswith("pending.")))]
            for t in ckpt.stages]


def _metrics_row(
    t: int, stats: IterationStats, previous: list[dict[str, Any]], time_s: float, iteration_s: float,
    device: str,
) -> dict[str, Any]:
    return {
        "iteration": t, "loss": stats.loss, "tokens": stats.tokens,
        "tokens_total": (previous[-1]["tokens_total"] if previous else 0) + stats.tokens,
        "time_s": round(time_s, 4), "lr": stats.lr,
        "tokens_per_s": round(stats.tokens / max(iteration_s, 1e-9), 1),
        "grad_norms": [round(n, 6) for n in stats.grad_norms],
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def train_local(
    cfg: Config, out_dir: str | Path, *, resume: bool = False, stop_after: int | None = None,
    on_iteration: OnIteration | None = None, say: Callable[[str], None] | None = None,
) -> LocalRunResult:
    """`gwtf train --local`: run cfg.train.iterations iterations in one process, writing outputs.

    Writes DIR/config.resolved.toml, DIR/metrics.jsonl (one object per iteration), DIR/loss.png
    and DIR/checkpoint/. With `resume`, continues after the last checkpoint; the metrics of the
    continued run equal those of an uninterrupted one (wall-clock fields aside).
    `stop_after` ends this invocation after that many completed iterations (tests, debugging);
    train.time_limit_s ends it after that much wall time. Both checkpoint before returning.
    The stages live on `train.device` (resolved: UserError for cuda without CUDA) and compute in
    `train.precision`; weights and optimizer state are float32 either way. With model.init_from
    they start from that model's weights (`gwtf.model.pretrained`), and the first metrics row also
    has `val_loss_start`, the validation loss of those weights before any step.
    """
    tc = cfg.train
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tc.torch_threads > 0:
        torch.set_num_threads(tc.torch_threads)
    torch.manual_seed(tc.seed)  # only dropout draws from it; init is seeded per stage
    device = resolve_device(tc.device, flag="train.device =")  # the commands check --device first
    kwargs = {"say": say} if say is not None else {}
    cfg = resolve_init(cfg)  # model.init_from: its shape and tokenizer (the stages load its weights)
    cfg = dataclasses.replace(cfg, data=resolve_source(cfg.data, **kwargs))  # the resolved config records it
    tc = cfg.train
    ckpt = _open_checkpoint(out, cfg) if resume else None
    dataset = load_dataset(cfg.data, cfg.model, tc.seed, tc.data_holders, microbatches=tc.microbatches, **kwargs)
    spec = model_spec(cfg.model, dataset.vocab_size)
    stages = [build_stage(spec, k, cfg.model.stages, tc.seed, device=device) for k in range(cfg.model.stages)]
    optimizers = [StageOptimizer(s, tc) for s in stages]
    start, elapsed0 = _restore(ckpt, out / "checkpoint", stages, optimizers) if ckpt else (0, 0.0)
    write_resolved(cfg, out)
    metrics_path = out / "metrics.jsonl"
    metrics = _read_metrics(metrics_path, start) if resume else []
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in metrics), encoding="utf-8")
    val_batches = dataset.val_microbatches(tc.eval_microbatches)
    w = cfg.wire
    rounding = StageGradRounding(w.stage_gradients, w.block_values, w.error_feedback) \
        if tc.local_rounding and w.stage_gradients != "fp32" else None
    # a run started from model.init_from reports the loss of those weights first (= `gwtf eval`)
    start_loss = evaluate(stages, val_batches, tc.precision) if cfg.model.init_from and start == 0 else None
    t0 = time.monotonic()
    completed, stopped = start, False
    # update_delay 1: the reduced gradients of the step not applied yet
    pending: StageGrads | None = ckpt_pending(ckpt, device) if ckpt else None
    with metrics_path.open("a", encoding="utf-8") as sink:
        for t in range(start, tc.iterations):
            t_it = time.monotonic()
            completed = t + 1
            last = completed == tc.iterations
            stats, grads = iteration_grads(stages, optimizers, dataset, t, tc, cfg.wire if tc.local_rounding else None,
                                           rounding)
            pending = take_steps(optimizers, t, grads, pending, tc.update_delay)
            if last and pending is not None:  # the run ends on its last step
                apply_steps(optimizers, t, pending)
                pending = None
            dt = time.monotonic() - t_it
            row = _metrics_row(t, stats, metrics, elapsed0 + time.monotonic() - t0, dt, device)
            if t == 0 and start_loss is not None:
                row["val_loss_start"] = start_loss
            stopped = not last and (
                (stop_after is not None and completed >= stop_after)
                or (tc.time_limit_s > 0 and time.monotonic() - t0 >= tc.time_limit_s)
            )
            if last or (tc.eval_every and completed % tc.eval_every == 0):
                row["val_loss"] = evaluate(stages, val_batches, tc.precision)
            elif stopped:  # a stopped run reports where it got to; resumed runs re-evaluate on cadence
                row["val_loss_at_stop"] = evaluate(stages, val_batches, tc.precision)
            metrics.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if on_iteration is not None:
                on_iteration(row)
            if last or stopped or (tc.checkpoint_every and completed % tc.checkpoint_every == 0):
                _save(out, completed, stages, optimizers, cfg, elapsed0 + time.monotonic() - t0, metrics, pending)
            if stopped:
                break
    return LocalRunResult(metrics=metrics, completed=completed, stopped_early=stopped, dataset=dataset)
