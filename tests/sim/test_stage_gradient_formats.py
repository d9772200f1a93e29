"""`wire.stage_gradients` on real tensors under the simulator (`gwtf.tensor_sim`, float64).

The within-stage reduction sends its parts in bf16 or int8 (with error feedback): every replica
of a stage must still take the bit-identical step (same weights hash after every step), with
gather and with the butterfly, without churn and with relays crashing at random protocol points
(mid-export, mid-reduction included); and the run stays close to the exact trainer: iteration 0's
loss is the reference's bit for bit (nothing is compressed before the first step), the next ones
within a small relative tolerance. fp32 stays exact (tests/sim/test_real_tensors.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from gwtf.config import load_config
from gwtf.model.data import load_dataset
from gwtf.sim.scenario import build, load_scenario
from gwtf.tensor_sim import TensorRun, config_for, reference_stages, relay_crash_schedule, run_with_tensors

K = 3
SCENARIO = [
    'model.preset="tiny"', "model.seq_len=16", "model.microbatch_size=2", "model.stages=3",
    "nodes.count=8", "nodes.data_holders=2", "nodes.relay_capacity=[1, 3]", f"train.iterations={K}",
    "train.microbatches=2", "sim.max_time_s=1500.0", "sim.progress_bound_s=600.0",
    # only the stage gradients are lossy here: iteration 0's loss is compared with the reference bit for bit
    'wire.activations="fp32"', 'wire.gradients="fp32"',
]
LOSS_RTOL = 1e-3  # int8 blockwise gradients after 1-2 AdamW steps (measured: <= 1.6e-4; bf16 2.5e-6)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, object, list[float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    cfg0 = load_config(None, ['data.source="synthetic"', 'data.tokenizer="byte"', f'data.cache_dir="{cache}"'])
    sc = load_scenario(None, SCENARIO)
    cfg = config_for(sc, cfg0)
    ds = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches)
    _, losses = reference_stages(cfg, ds, K)
    yield cfg0, ds, losses
    torch.set_num_threads(threads)


def _problems(run: TensorRun) -> list[str]:
    out: list[str] = []
    s = run.summary
    if not s.get("finished") or s.get("invariant_violations"):
        out.append(f"finished={s.get('finished')} violations={s.get('violations')}")
    for (stage, it), hashes in sorted(run.step_hashes.items()):
        if len(set(hashes.values())) != 1:
            out.append(f"stage {stage} iteration {it}: replicas diverged {hashes}")
    out += [f"{n} at version {v}" for n, v in sorted(run.version_of.items()) if v != K]
    return out


@pytest.mark.parametrize("fmt,reduce", [("int8", "gather"), ("int8", "butterfly"), ("bf16", "butterfly")])
def test_lossy_stage_gradients_keep_replicas_identical(base: tuple[object, object, list[float]], fmt: str,
                                                      reduce: str) -> None:
    cfg0, ds, ref_losses = base
    sc = load_scenario(None, [*SCENARIO, f'wire.stage_gradients="{fmt}"', f'protocol.reduce="{reduce}"'])
    cfg = config_for(sc, cfg0)  # type: ignore[arg-type]
    built = build(sc, 7)
    run = run_with_tensors(sc, 0, cfg, ds, built=built)  # type: ignore[arg-type]
    assert _problems(run) == []
    assert cfg.wire.stage_gradients == fmt
    means = [sum(run.losses[it]) / len(run.losses[it]) for it in range(K)]
    assert means[0] == pytest.approx(ref_losses[0], rel=1e-12)
    for it in range(1, K):
        assert means[it] == pytest.approx(ref_losses[it], rel=LOSS_RTOL), (it, means[it], ref_losses[it])
    assert means[1:] != ref_losses[1:]  # the format did apply (an exact run would match to 1e-12)
    failures = []
    for seed in (1, 2, 3):
        faults, _ = relay_crash_schedule(random.Random(f"stage-grads:{seed}"), built[0].by_stage,
                                         float(run.summary["training_time_s"]), 3, 2)
        crashed = run_with_tensors(replace(sc, faults=tuple(faults)), seed, cfg, ds, built=built)  # type: ignore[arg-type]
        failures += [f"seed {seed}: {p}" for p in _problems(crashed)]
    assert failures == [], "\n".join(failures)
