"""Loss curves of several runs side by side in one PNG, and their table against the first.

    python benchmarks/loss_curves.py --out docs/img/update-delay-loss.png \
        "fp32, delay 0=runs/fp32-d0/metrics.jsonl" "fp32, delay 1=runs/fp32-d1/metrics.jsonl"

Each argument is `LABEL=PATH` to a `metrics.jsonl` (`gwtf train --local` or a swarm's). The
table: final loss, mean loss, final validation loss, each with its delta to the first run, and
the first iteration at which the first run reached each run's final loss (how many iterations
of the first run the others' end is worth). Benchmarks are not tests: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _rows(path: str) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=PATH to a metrics.jsonl")
    ap.add_argument("--out", default="loss_curves.png")
    ap.add_argument("--smooth", type=int, default=10, help="moving-average window of the training loss")
    args = ap.parse_args(argv)
    runs = [(label, _rows(path)) for label, _, path in (r.partition("=") for r in args.runs)]
    base = [r["loss"] for r in runs[0][1]]
    print("| run | final loss | delta | mean loss | delta | final val loss | delta | first run reached it at |")
    print("|---|---|---|---|---|---|---|---|")
    b_final, b_mean = base[-1], statistics.mean(base)
    b_val = [r["val_loss"] for r in runs[0][1] if r.get("val_loss") is not None][-1]
    for label, rows in runs:
        loss = [r["loss"] for r in rows]
        val = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
        reached = next((t for t, x in enumerate(base) if x <= loss[-1]), None)
        print(f"| {label} | {loss[-1]:.4f} | {loss[-1] - b_final:+.4f} ({100 * (loss[-1] / b_final - 1):+.1f}%) | "
              f"{statistics.mean(loss):.4f} | {statistics.mean(loss) - b_mean:+.4f} | {val:.4f} | "
              f"{val - b_val:+.4f} ({100 * (val / b_val - 1):+.1f}%) | iteration {reached} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, av) = plt.subplots(1, 2, figsize=(11, 4))
    k = max(1, args.smooth)
    for label, rows in runs:
        loss = [r["loss"] for r in rows]
        smooth = [statistics.mean(loss[max(0, t - k + 1):t + 1]) for t in range(len(loss))]
        ax.plot([r["iteration"] for r in rows], smooth, label=label)
        vals = [(r["iteration"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        av.plot([v[0] for v in vals], [v[1] for v in vals], marker="o", label=label)
    ax.set(xlabel="iteration", ylabel=f"training loss ({k}-iteration mean)", title="training loss")
    av.set(xlabel="iteration", ylabel="validation loss", title="validation loss")
    for a in (ax, av):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
