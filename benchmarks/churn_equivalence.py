"""`gwtf swarm --churn high` against `gwtf train --local`, same config and seed (issue 42).

usage: python benchmarks/churn_equivalence.py ITERATIONS SEED [SEED ...]

Per seed: a local swarm of the demo config (2 data holders, 2 replicas of each relay stage)
with `--churn high` (kills data holders, the leader and relays; starts joiners), the audit, and
the reference trainer on the same config and seed. Prints one JSON line per seed: finished, the
audit's problems and totals, who was killed, whether every iteration trained the full batch,
and the largest relative difference of an iteration's loss from the reference trainer's.
Outputs under /tmp/churneq/ (not kept). A benchmark, not a test: minutes per seed.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from gwtf.config import load_config
from gwtf.model.trainer import train_local
from gwtf.runtime.swarm import Swarm, SwarmOptions

CFG = "configs/swarm-demo.toml"
its = int(sys.argv[1])
seeds = [int(s) for s in sys.argv[2:]]
for seed in seeds:
    ov = [f"train.iterations={its}", f"train.seed={seed}"]
    cfg = load_config(CFG, ov)
    out = Path(f"/tmp/churneq/s{seed}")
    shutil.rmtree(out, ignore_errors=True)
    sw = Swarm(cfg, SwarmOptions(out_dir=out / "swarm", replicas=2, churn="high", config_path=CFG, overrides=tuple(ov)),
               say=lambda s: print("  swarm:", s, flush=True))
    with sw:
        sw.start()
        ok = sw.run_until(its, 600.0)
        problems, totals = sw.audit(its)
        rows = sw.metrics.rows[:its]
        killed = [p.name for p in sw.group.procs if p.state == "killed"]
        dh_killed = [n for n in killed if n.startswith("dh") or n in sw.metrics.holder_from]
    torch.set_num_threads(1)
    ref = [float(m["loss"]) for m in train_local(cfg, out / "local").metrics]
    got = [r["loss"] for r in rows]
    full = all(r["microbatches"] == rows[0]["microbatches"] for r in rows)
    err = float(np.max(np.abs(np.array(got) - np.array(ref)) / np.abs(np.array(ref)))) if len(got) == len(ref) else float("nan")
    print(json.dumps({"seed": seed, "finished": ok, "audit_problems": len(problems), "totals": totals,
                      "killed": killed, "data_holders_killed": dh_killed, "crashes": sw.crashes, "joins": sw.joins,
                      "full_batch_every_iteration": full, "max_rel_loss_diff": err,
                      "originals_all_dead": all(p.state == "killed" for p in sw.group.procs if p.name in ("dh0", "dh1"))}), flush=True)
