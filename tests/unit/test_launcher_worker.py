"""The node's torch stage worker, wired by hand in one process (no sockets, no protocol core).

Two data holders and two replicas of every relay stage run the worker's jobs exactly as the node
driver does (embed, forward, loss, backward with detach/re-leaf at every boundary, flat gradient
exchange, sorted-replica aggregation, step). The losses must equal the reference trainer's
`train_iteration` up to float32 summation order (rtol 1e-5), and replicas of a stage must hold
bit-identical weights (equal hashes) after every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.model.data import TokenDataset, load_dataset
from gwtf.model.presets import ModelSpec, model_spec
from gwtf.model.stage import build_stage
from gwtf.model.trainer import StageOptimizer, train_iteration
from gwtf.runtime.worker import GradientRejected, StageWorker


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Config, TokenDataset, ModelSpec]]:
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    cfg = load_config(None, [
        'data.source="synthetic"', 'data.tokenizer="byte"', f'data.cache_dir="{cache}"', "model.seq_len=16",
        "model.microbatch_size=2", "train.microbatches=2", "train.data_holders=2", "model.stages=3",
    ])
    ds = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches)
    yield cfg, ds, model_spec(cfg.model, ds.vocab_size)


def _microbatch(dh: StageWorker, relays: list[StageWorker], it: int, m: int) -> float:
    """One microbatch through the workers: data holder -> relays -> data holder -> reverse."""
    mb = (dh.shard, it, m)
    dh.embed(mb, it, m, ("act", mb, 0))
    prev = dh
    for k, r in enumerate(relays, start=1):
        r.put(("act", mb, k - 1), prev.to_numpy(("act", mb, k - 1)))
        r.forward(mb, ("act", mb, k - 1), ("act", mb, k))
        prev = r
    dh.put(("act", mb, len(relays)), prev.to_numpy(("act", mb, len(relays))))
    loss = dh.loss(mb, ("act", mb, len(relays)), ("grad", mb, len(relays)))
    nxt = dh
    for k in range(len(relays), 0, -1):
        r = relays[k - 1]
        r.put(("grad", mb, k), nxt.to_numpy(("grad", mb, k)))
        r.backward(mb, ("grad", mb, k), ("grad", mb, k - 1))
        nxt = r
    dh.put(("grad", mb, 0), nxt.to_numpy(("grad", mb, 0)))
    dh.backward(mb, ("grad", mb, 0), None)
    return loss


def _step(workers: list[StageWorker], it: int) -> set[str]:
    shared = [(f"r{i}", torch.from_numpy(w.grads_flat().numpy().copy()), w.microbatches_accumulated)
              for i, w in enumerate(workers)]
    return {w.step(it, shared) for w in workers}


def test_replicated_workers_match_reference_trainer(setup: tuple[Config, TokenDataset, ModelSpec]) -> None:
    cfg, ds, spec = setup
    stages = cfg.model.stages
    ref = [build_stage(spec, k, stages, cfg.train.seed) for k in range(stages)]
    ref_opt = [StageOptimizer(m, cfg.train) for m in ref]
    dhs = [StageWorker(cfg, spec, 0, dataset=ds, shard=d) for d in range(2)]
    relays = {k: [StageWorker(cfg, spec, k) for _ in range(2)] for k in range(1, stages)}
    for it in range(3):
        expected = train_iteration(ref, ref_opt, ds, it, cfg.train).loss
        losses = [_microbatch(dh, [relays[k][m % 2] for k in range(1, stages)], it, m)
                  for dh in dhs for m in range(cfg.train.microbatches)]
        assert np.isclose(sum(losses) / len(losses), expected, rtol=1e-5, atol=0)
        assert len(_step(dhs, it)) == 1
        for k in range(1, stages):
            assert len(_step(relays[k], it)) == 1, f"stage {k} replicas diverged"
    ref_relay = ref_opt[1].params
    got = relays[1][0].optimizer.params
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ref_relay, got, strict=True))


def test_state_blob_gives_joiner_identical_weights_and_optimizer(
    setup: tuple[Config, TokenDataset, ModelSpec], tmp_path: Path
) -> None:
    cfg, ds, spec = setup
    dh = StageWorker(cfg, spec, 0, dataset=ds, shard=0)
    old, joiner = StageWorker(cfg, spec, 1), StageWorker(cfg, spec, 1, device="cpu")
    for m in range(2):
        _microbatch(dh, [old, StageWorker(cfg, spec, 2)], 0, m)
    _step([old], 0)
    joiner.load_state_blob(old.state_blob())
    assert joiner.weights_hash() == old.weights_hash()
    # one more identical step on both: optimizer state must have travelled too
    g = old.grads_flat() + 1e-3
    assert old.step(1, [("a", g, 1)]) == joiner.step(1, [("a", g.clone(), 1)])


def test_non_finite_gradient_is_rejected(setup: tuple[Config, TokenDataset, ModelSpec]) -> None:
    cfg, _, spec = setup
    w = StageWorker(cfg, spec, 1)
    w.put(("act", "mb", 0), np.zeros((2, 16, spec.d_model), dtype=np.float32))
    w.forward("mb", ("act", "mb", 0), ("act", "mb", 1))
    w.put(("grad", "mb", 1), np.full((2, 16, spec.d_model), np.nan, dtype=np.float32))
    with pytest.raises(GradientRejected, match="grad"):
        w.backward("mb", ("grad", "mb", 1), ("grad", "mb", 0))
    bad = w.grads_flat()
    bad[0] = float("inf")
    with pytest.raises(GradientRejected):
        w.step(0, [("x", bad, 1)])


def test_a_reduction_without_contributions_is_a_zero_gradient(setup: tuple[Config, TokenDataset, ModelSpec]) -> None:
    """High-churn seed 4 in real processes: the leader dh0 died in the iteration a joiner was made a
    data holder (it trains its shard from the next one), so stage 0 committed no contribution; the
    reducer stopped with 'reduction without contributions' and the swarm with it."""
    cfg, _, spec = setup
    a, b = StageWorker(cfg, spec, 1), StageWorker(cfg, spec, 1)
    zero = a.reduce([], 0)
    assert zero.shape == a.grads_flat().shape and not zero.any()
    assert a.step(0, [("x", zero, 0)]) == b.step(0, [("x", torch.zeros_like(zero), 0)])
