"""kill -9 of every node process at once, then `--resume` into the same folder: the swarm continues
at the newest checkpoint complete for all stages, and the loss curve continues exactly.

Setting: configs/swarm-test.toml, 3 stages (2 data holders, 2 replicas of stages 1 and 2: 6
processes), 12 iterations, a checkpoint every 3. The first run is killed as soon as the test has
seen 4 iterations complete (version 3 is on disk, a later one may be: the nodes run ahead of the
test's polling), well before its end. The resumed run must start at the newest version V complete
for all stages, train V..11 with the losses of the reference trainer `gwtf train --local` (the same config and seed;
the equivalence test's tolerance for a longer run, rtol 1e-4), and pass the exactly-once audit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gwtf.config import load_config
from gwtf.model.trainer import train_local
from gwtf.runtime import checkpoints
from gwtf.runtime.swarm import Swarm, SwarmOptions

TEST_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")
OVERRIDES = ("model.stages=3", "train.iterations=12", "protocol.checkpoint_every=3")
ITERATIONS = 12


def _reference_losses(out: Path) -> list[float]:
    torch.set_num_threads(1)
    return [float(m["loss"]) for m in train_local(load_config(TEST_CONFIG, list(OVERRIDES)), out).metrics]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill_every_process_then_resume_continues_the_loss_curve(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], tmp_path: Path
) -> None:
    first = make_swarm(OVERRIDES, name="run")
    first.start()
    if not first.run_until(4, 120):
        pytest.fail(f"first run: {len(first.metrics.rows)}/4 iterations\n{first.log_tails()}")
    seen = len(first.metrics.rows)
    first.group.close()  # SIGKILL to every node at once, mid-run
    first.close()
    out = first.opts.out_dir
    version = checkpoints.newest_complete(out / "checkpoints", 3)
    assert version is not None and 3 <= version < ITERATIONS, version
    assert version % 3 == 0
    print(f"killed after {seen} iterations seen; resuming at version {version}")

    opts = SwarmOptions(out_dir=out, replicas=2, config_path=TEST_CONFIG, overrides=OVERRIDES, resume=True)
    with Swarm(load_config(TEST_CONFIG, list(OVERRIDES)), opts, say=lambda s: None) as resumed:
        assert resumed.first == version
        resumed.start()
        totals = finish(resumed, ITERATIONS, 150)  # exactly-once audit of iterations V..11
        records = resumed.metrics.records
    assert totals["expected"] == 4 * (ITERATIONS - version) * 3
    # the resumed leader started at V and no node trained an iteration before it
    starts = [r["iteration"] for r in records["dh0"] if r["event"] == "iter_start"]
    assert starts[0] == version and min(starts) == version
    assert all(r["iteration"] >= version for rows in records.values() for r in rows if r["event"] == "decision")
    assert (out / "nodes-1" / "dh0" / "records.jsonl").is_file()  # the killed run's logs are kept

    want = _reference_losses(tmp_path / "local")
    rows = resumed.metrics.rows
    got = {r["iteration"]: r["loss"] for r in rows}
    assert sorted(i for i in got if i >= version) == list(range(version, ITERATIONS))
    np.testing.assert_allclose([got[i] for i in range(version, ITERATIONS)], want[version:], rtol=1e-4, atol=0)
    # metrics.jsonl continues: the killed run's rows before V, then the resumed ones, once each
    on_disk = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept, new = on_disk[:-(ITERATIONS - version)], on_disk[-(ITERATIONS - version):]
    assert new == list(range(version, ITERATIONS))
    assert kept == list(range(len(kept))) and len(kept) <= version
