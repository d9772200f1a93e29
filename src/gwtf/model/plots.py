"""Training plots: `loss.png` from a run's metrics.

Owns: drawing the training loss (and validation loss when present) against iteration with
matplotlib's Agg canvas directly, so importing this never changes the process-wide backend and
never needs a display. Must not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot_loss"]


def plot_loss(metrics: Sequence[dict[str, Any]], path: str | Path, title: str = "training loss") -> Path:
    """Write a PNG of loss (and val_loss) per iteration; atomic (temp file + rename).

    Args:
        metrics: one dict per iteration with `iteration`, `loss` and optionally `val_loss`.
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
