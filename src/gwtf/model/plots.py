"""Training plots: `loss.png` from a run's metrics.

Owns: drawing the training loss (and validation loss when present) against iteration, with the
crashes and joins of a swarm run marked (red solid / green dashed lines at the iteration whose
row first counts them: `churn_marks`), with matplotlib's Agg canvas directly, so importing this never changes the process-wide backend and
never needs a display. Must not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["churn_marks", "plot_loss"]


def churn_marks(metrics: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(iterations where a crash was first counted, ... a join), one entry per event, from the
    cumulative `crashes` / `joins` fields of a swarm's metrics rows (none in a local run's)."""
    marks: dict[str, list[int]] = {"crashes": [], "joins": []}
    for key, out in marks.items():
        before = 0
        for m in metrics:
            now = m.get(key)
            if isinstance(now, int) and now > before:
                out += [int(m["iteration"])] * (now - before)
                before = now
    return marks["crashes"], marks["joins"]


def plot_loss(metrics: Sequence[dict[str, Any]], path: str | Path, title: str = "training loss") -> Path:
    """Write a PNG of loss (and val_loss) per iteration; atomic (temp file + rename).

    Args:
        metrics: one dict per iteration with `iteration`, `loss` and optionally `val_loss`,
            `crashes`, `joins` (cumulative counts: marked where they grow).
        path: where to write the PNG.
        title: figure title.

    Returns:
        The path written.
    """
    out = Path(path)
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    its = [int(m["iteration"]) for m in metrics]
    ax.plot(its, [float(m["loss"]) for m in metrics], label="train loss", linewidth=1.0)
    val = [(int(m["iteration"]), float(m["val_loss"])) for m in metrics if m.get("val_loss") is not None]
    if val:
        ax.plot([v[0] for v in val], [v[1] for v in val], "o-", label="val loss", markersize=3)
    crashes, joins = churn_marks(metrics)
    for i, it in enumerate(crashes):
        ax.axvline(it, color="tab:red", lw=0.8, alpha=0.7, label="crash" if i == 0 else None)
    for i, it in enumerate(joins):
        ax.axvline(it, color="tab:green", lw=0.8, ls="--", alpha=0.7, label="join (served)" if i == 0 else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out
