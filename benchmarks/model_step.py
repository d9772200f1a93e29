"""Benchmark: tokens/s of one full training step (forward + backward + AdamW) on CPU.

Runs the monolithic GPT-family model for the `tiny` preset (vocab 2048, the default BPE size)
and the `124m` preset (GPT-2 vocab 50257, untied head: 163M parameters) at 1 and 2 torch
threads and prints a table with the 2-thread / 1-thread ratio. Standalone:

    .venv/bin/python benchmarks/model_step.py            # ~1-2 min on a 2-core box

Numbers on a shared machine are noisy; the *fastest* of a few timed steps is reported (other
processes only ever add time, so the minimum is the least contaminated estimate).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from gwtf.model.presets import ModelSpec, preset_dims
from gwtf.model.transformer import build_model


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    preset: str
    vocab_size: int
    batch: int
    seq_len: int
    warmup_steps: int
    timed_steps: int


CASES = (
    Case(preset="tiny", vocab_size=2048, batch=8, seq_len=128, warmup_steps=2, timed_steps=10),
    Case(preset="124m", vocab_size=50257, batch=1, seq_len=128, warmup_steps=1, timed_steps=3),
)


def step_seconds(case: Case, threads: int) -> tuple[float, int]:
    """Fastest wall seconds of one training step, and the model's parameter count."""
    torch.set_num_threads(threads)
    spec = ModelSpec(family="gpt", vocab_size=case.vocab_size, seq_len=case.seq_len,
                     **preset_dims(case.preset, "gpt"))
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, case.vocab_size, (case.batch, case.seq_len + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    times: list[float] = []
    for i in range(case.warmup_steps + case.timed_steps):
        start = time.perf_counter()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= case.warmup_steps:
            times.append(time.perf_counter() - start)
    return min(times), spec.param_count()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--presets", nargs="+", default=[c.preset for c in CASES])
    args = parser.parse_args()
    header = f"{'preset':<7} {'params':>9} {'tokens/step':>11}"
    header += "".join(f" {f'tok/s@{t}t':>10} {f'ms@{t}t':>8}" for t in args.threads)
    header += f" {'ratio':>6}" if len(args.threads) > 1 else ""
    print(header)
    for case in CASES:
        if case.preset not in args.presets:
            continue
        tokens = case.batch * case.seq_len
        row, rates = "", []
        for threads in args.threads:
            secs, params = step_seconds(case, threads)
            rates.append(tokens / secs)
            row += f" {rates[-1]:>10.0f} {secs * 1e3:>8.1f}"
        ratio = f" {rates[-1] / rates[0]:>6.2f}" if len(rates) > 1 else ""
        print(f"{case.preset:<7} {params / 1e6:>8.1f}M {tokens:>11}{row}{ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
