"""A swarm's metrics.jsonl rows: lr, per-stage grad norms, reroutes, and the validation loss of
the checkpoints every train.eval_every iterations (computed like train --local's)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from gwtf.config import load_config
from gwtf.model.data import load_dataset
from gwtf.model.plots import churn_marks
from gwtf.model.presets import model_spec
from gwtf.model.stage import build_stage
from gwtf.model.trainer import evaluate
from gwtf.runtime import checkpoints
from gwtf.runtime.launcher import NodePlan, NodeProcess
from gwtf.runtime.status import RECORDS_FILE, node_dir
from gwtf.runtime.swarm import SwarmMetrics
from gwtf.runtime.validation import CheckpointValidation

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml"


class _Running:
    """A process that is still running (the metrics only ask `poll()`)."""

    returncode = None

    def poll(self) -> None:
        return None


def _proc(out: Path, name: str, role: str, stage: int) -> NodeProcess:
    plan = NodePlan(name=name, role=role, stage=str(stage))
    popen: Any = _Running()
    return NodeProcess(plan=plan, popen=popen, dir=node_dir(out, name), started_s=0.0)


def _write(proc: NodeProcess, *rows: dict[str, Any]) -> None:
    with (proc.dir / RECORDS_FILE).open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"unix_s": 1.0, **row}) + "\n")


def _stepped(it: int, stage: int, norm: float) -> dict[str, Any]:
    return {"event": "stepped", "iteration": it, "stage": stage, "hash": f"h{it}", "lr": 0.001 * (it + 1),
            "grad_norm": norm, "tokens_per_s": 100.0, "iteration_s": 0.1}


def test_rows_carry_lr_grad_norms_reroutes_and_val_loss(tmp_path: Path) -> None:
    dh, relay = _proc(tmp_path, "dh0", "data-holder", 0), _proc(tmp_path, "r1a", "relay", 1)
    asked: list[int] = []

    def validation(version: int) -> float:
        asked.append(version)
        return 2.5

    m = SwarmMetrics(tmp_path, microbatches=1, validation=validation, eval_every=2, iterations=3, stages=2)
    for it in range(3):
        _write(dh, {"event": "loss", "iteration": it, "index": 0, "loss": 5.0 - it, "tokens": 32},
               _stepped(it, 0, 1.5))
    _write(relay, {"event": "reroute", "node": "dh0", "mb": ["dh0", 1, 0]}, {"event": "redo", "mb": ["dh0", 1, 0]},
           _stepped(0, 1, 0.5))
    m.poll([dh, relay])
    rows = m.complete([dh, relay], 0.0, crashes=1, joins=0)
    # iteration 1 is evaluated: its row waits until stage 1 stepped too (its checkpoint exists then)
    assert [r["iteration"] for r in rows] == [0]
    assert rows[0]["lr"] == 0.001 and rows[0]["grad_norms"] == [1.5, 0.5] and "val_loss" not in rows[0]
    _write(relay, _stepped(1, 1, 0.25), _stepped(2, 1, 0.125))
    m.poll([dh, relay])
    rows += m.complete([dh, relay], 0.0, crashes=1, joins=1)
    m.close()
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["microbatches_rerouted"] == 1 and rows[1]["microbatches_redone"] == 1
    assert rows[0]["microbatches_rerouted"] == 0
    assert (rows[1]["val_loss"], rows[2]["val_loss"]) == (2.5, 2.5) and asked == [2, 3]
    on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == rows
    assert churn_marks(rows) == ([0], [1])


def test_validation_of_a_checkpoint_equals_the_local_trainers(tmp_path: Path) -> None:
    cfg = load_config(str(CONFIG), [])
    cfg = replace(cfg, train=replace(cfg.train, eval_microbatches=3))
    dataset = load_dataset(cfg.data, cfg.model, cfg.train.seed, cfg.train.data_holders, microbatches=cfg.train.microbatches)
    spec = model_spec(cfg.model, dataset.vocab_size)
    stages = [build_stage(spec, k, cfg.model.stages, seed=7) for k in range(cfg.model.stages)]  # not the initial weights
    ckpt = tmp_path / checkpoints.CHECKPOINTS_DIR
    for k, stage in enumerate(stages):
        blob = st_save({f"w.{n}": t.contiguous() for n, t in stage.state_dict().items()} |
                       {"opt.dummy": torch.zeros(1)})
        checkpoints.write_version(ckpt, k, 5, blob)
    val = CheckpointValidation(cfg, tmp_path)
    expected = evaluate(stages, dataset.val_microbatches(3))
    assert expected is not None and val(5) == expected
    assert val(10) is None  # no checkpoint of that version

