"""`--secret-file` and $GWTF_SWARM_SECRET reach real node processes: nodes started by a
`ProcessGroup` (as `gwtf swarm` starts them) with a `gwtf secret new` file form a swarm with a
node given the same secret in the environment; a node holding another secret is refused at its
join contact's handshake and exits before READY, and the swarm keeps serving: its data holder's
iteration advances after the refusal. The swarm is given far more iterations than the test
watches, so that it cannot finish (and its processes exit 0) while the stranger is refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gwtf.runtime import keys
from gwtf.runtime.launcher import NodePlan, NodeProcess, NodeStartError, ProcessGroup
from gwtf.runtime.status import STATUS_FILE, read_status

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")


LONG_RUN = ("train.iterations=10000",)  # the swarm must outlive the test; close() kills it


def _iteration(proc: NodeProcess) -> int:
    return int((read_status(proc.dir / STATUS_FILE) or {}).get("iteration") or 0)


def _wait_iteration(procs: list[NodeProcess], past: int, timeout_s: float) -> None:
    """Until procs[0]'s iteration exceeds `past`; every proc must stay alive meanwhile."""
    deadline = time.monotonic() + timeout_s
    while _iteration(procs[0]) <= past:
        for p in procs:
            assert p.alive(), f"{p.name} exited with code {p.popen.poll()}:\n{p.log_tail()}"
        assert time.monotonic() < deadline, f"{procs[0].name} not past iteration {past} within {timeout_s}s"
        time.sleep(0.05)  # polling period of a bounded wait


def _wait_active(procs: list[NodeProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        pending = [p for p in pending if (read_status(p.dir / STATUS_FILE) or {}).get("state") != "active"]
        for p in pending:
            assert p.alive(), f"{p.name} died:\n{p.log_tail()}"
            assert time.monotonic() < deadline, f"{p.name} not active within {timeout_s}s:\n{p.log_tail()}"
        time.sleep(0.05)  # polling period of a bounded wait


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_secret_file_and_env_secret_join_one_swarm_and_another_secret_is_refused(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "swarm.secret", tmp_path / "other.secret"
    keys.write_new_secret(ours)
    keys.write_new_secret(theirs)
    env = {keys.SECRET_ENV: ours.read_text().strip()}
    with ProcessGroup(tmp_path / "run", CONFIG, LONG_RUN, secret_file=str(ours)) as group, \
            ProcessGroup(tmp_path / "run", CONFIG, LONG_RUN, extra_env=env) as env_group, \
            ProcessGroup(tmp_path / "run", CONFIG, LONG_RUN, secret_file=str(theirs)) as stranger:
        first = group.spawn(NodePlan(name="dh0", role="data-holder", stage="0", shard=0))
        group.wait_ready([first], timeout_s=60)
        bad = stranger.spawn(NodePlan(name="x1", stage="1"), join=first.addr)
        r1 = group.spawn(NodePlan(name="r1a", stage="1"), join=first.addr)
        r2 = env_group.spawn(NodePlan(name="r2a", stage="2"), join=first.addr)
        group.wait_ready([r1], timeout_s=60)
        env_group.wait_ready([r2], timeout_s=60)
        _wait_active([first, r1, r2], timeout_s=60)
        with pytest.raises(NodeStartError, match="x1 exited with code [1-9]"):
            stranger.wait_ready([bad], timeout_s=60)
        refused_at = _iteration(first)
        _wait_iteration([first, r1, r2], past=refused_at, timeout_s=60)
