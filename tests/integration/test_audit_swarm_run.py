"""`gwtf audit` on the out folder of a real swarm finds what `Swarm.audit` found: exit 0 and the
same totals, with the config from the flags (the nodes wrote none) and from the run folder's
`config.resolved.toml` (as `gwtf swarm` writes it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_CONFIG, Finish, MakeSwarm
from gwtf.config import write_resolved


def _audit(*args: str) -> tuple[int, dict[str, object], str]:
    proc = subprocess.run([sys.executable, "-m", "gwtf", "audit", *args, "--json"], capture_output=True,
                          text=True, timeout=60, check=False)
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else {}), proc.stderr


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_gwtf_audit_of_a_swarm_run_matches_the_swarms_own_audit(make_swarm: MakeSwarm, finish: Finish) -> None:
    overrides = ("model.stages=2", "train.iterations=3")
    swarm = make_swarm(overrides)
    swarm.start()
    finish(swarm, 3, 90)
    swarm.close()  # every record on disk: the command reads the very files the swarm's audit read
    problems, totals = swarm.audit(3)
    assert not problems
    out: Path = swarm.opts.out_dir
    sets = [arg for o in overrides for arg in ("--set", o)]
    code, summary, err = _audit(str(out), "--config", TEST_CONFIG, *sets)
    assert code == 0, err + json.dumps(summary, indent=1)
    assert summary["clean"] is True and summary["violations"] == []
    assert (summary["first"], summary["end"], summary["audited"]) == (0, 3, 3)
    assert {k: summary[k] for k in totals} == totals
    assert totals["expected"] == 4 * 3 * 2 and totals["hashed"] == 3 * 2
    # the global batch's account (the simulator's): 2 data holders x 2 microbatches, every iteration
    assert (totals["full_batch"], totals["short_iterations"], totals["short_detail"]) == (4, 0, [])
    assert (totals["reserved"], totals["dropped"]) == (0, 0)
    assert summary["nodes"] == sorted(p.name for p in swarm.group.procs)

    write_resolved(swarm.cfg, out)  # what `gwtf swarm` writes: no --config needed then
    code, again, err = _audit(str(out))
    assert code == 0, err
    assert {k: again[k] for k in totals} == totals and again["config"] == str(out / "config.resolved.toml")
