"""docs/multi-host.md followed to the letter, one "machine" per loopback address (issue 44 item 5).

Each machine is a folder of its own (its copy of the secret and of the config, its `--out`
folder, what its terminal showed) with a loopback address of its own (127.0.0.2 ... 127.0.0.7,
a free port on each); every node runs in its machine's folder with the doc's relative paths.
1. `gwtf secret new swarm.secret` on machine a, copied to every other machine (mode 0600);
2. configs/swarm-demo.toml copied everywhere as swarm.toml, with the same `--set` flags on
   every node and on the audit (12 iterations, a checkpoint every 4, `runtime.start_members`
   of the doc's example: the leader holds iteration 0 until all 6 nodes joined), and
   `gwtf data prepare shakespeare` (offline without a cached copy it falls back to the
   synthetic corpus, and every node is then given that source, so that all agree);
3. the nodes started by hand with section 3's flags, wave by wave: dh0 (`--role data-holder
   --shard 0`, no `--join`), dh1 joining through dh0, two relays (`--role relay --stage auto`)
   through dh1 (a data holder that is not the leader), two more through those relays: the
   demo's D = 2 data holders and 2 replicas of each of its 2 relay stages. READY then SERVING
   read from each terminal with a deadline, their fields checked against the doc;
4. after 3 iterations one relay is killed (kill -9 of its process group, a crash): the others
   finish all 12 iterations, each prints `training finished (...)` and exits 0 by itself, and
   the leader names the lost member. The first node "resumed" with the resume section's
   command says in one line that the run is finished and exits 0. Every machine's `--out`
   folder copied to one machine, `gwtf audit ... --config swarm.toml --set ... --json`: exit 0,
   no violation, nothing dropped, every iteration audited;
5. the resume section's case, a stopped swarm: a second run in fresh folders (its 4 relays
   joining at once through dh1, once both data holders serve), every node killed (kill -9)
   once dh0's own folder holds a checkpoint complete for all stages (its stage 0 and its copies
   of the relays'), then the same nodes again with `--resume`, the first node first, the others
   joining through it as in the resume section's commands: dh0 says the version it resumes
   from, every node finishes and exits 0, and the audit of the gathered folders (the killed
   start set aside) is clean from that version on.

Every process is started in its own session and killed (its process group, SIGKILL) at the end;
every wait is a poll with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gwtf.runtime import checkpoints
from gwtf.runtime.checkpoints import newest_complete

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "swarm-demo.toml"
ITERATIONS = 12
EVERY = 4
NODES = 6  # the demo's 2 data holders + 2 replicas of each of its 2 relay stages
SETS = [f"train.iterations={ITERATIONS}", f"protocol.checkpoint_every={EVERY}", f"runtime.start_members={NODES}"]
KILL_AFTER = 3  # iterations stepped before the relay is killed
POLL_S = 0.05  # polling period of the bounded waits below


NAMES = ("dh0", "dh1", "r1", "r2", "r3", "r4")
# each node's --join contact (dh0: none) and the waves they start in, each wave once the one before
# serves: the first run joins relays through dh1 (a data holder that is not the leader) and through
# relays, the second through dh1, its resumed start through the first node, as the resume section does
Plan = tuple[dict[str, str], tuple[tuple[str, ...], ...]]
FIRST_RUN: Plan = ({"dh1": "dh0", "r1": "dh1", "r2": "dh1", "r3": "r1", "r4": "r2"},
                   (("dh0",), ("dh1",), ("r1", "r2"), ("r3", "r4")))
SECOND_RUN: Plan = ({"dh1": "dh0", "r1": "dh1", "r2": "dh1", "r3": "dh1", "r4": "dh1"},
                    (("dh0",), ("dh1",), ("r1", "r2", "r3", "r4")))
RESUMED: Plan = ({name: "dh0" for name in NAMES[1:]}, SECOND_RUN[1])


@dataclass
class Machine:
    """One "machine": its folder (the node's working directory), its address and its node."""

    letter: str
    name: str
    host: str
    port: int
    dir: Path
    out: str = ""  # this run's --out folder, relative to `dir` as in the doc
    terminal: Path | None = None  # what its terminal shows of the node started last
    proc: subprocess.Popen[bytes] | None = None
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def listen(self) -> str:
        return f"{self.host}:{self.port}"

    def lines(self) -> list[str]:
        try:
            return self.terminal.read_text(encoding="utf-8", errors="replace").splitlines() if self.terminal else []
        except OSError:
            return []

    def log(self) -> list[str]:
        return (self.dir / self.out / "nodes" / self.name / "stdout.log").read_text(
            encoding="utf-8", errors="replace").splitlines()

    def records(self) -> list[dict[str, Any]]:
        try:
            text = (self.dir / self.out / "nodes" / self.name / "records.jsonl").read_text(
                encoding="utf-8", errors="replace")
        except OSError:
            return []
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written
                continue
        return rows


def _gwtf(*args: str) -> list[str]:
    return [sys.executable, "-m", "gwtf", *args]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _node_flags(m: Machine, contact: Machine | None) -> list[str]:
    """docs/multi-host.md section 3's command line for this machine's node."""
    flags = ["--listen", m.listen]
    if contact is not None:
        flags += ["--join", contact.listen]
    if m.name.startswith("dh"):
        flags += ["--role", "data-holder", "--shard", m.name[2:]]
    else:
        flags += ["--role", "relay", "--stage", "auto"]
    return flags + ["--name", m.name, "--config", "swarm.toml", "--secret-file", "swarm.secret", "--out", m.out,
                    "--device", "cpu"]


def _tails(machines: list[Machine]) -> str:
    return "\n".join(f"--- {m.name} ({m.listen}):\n" + "\n".join(m.lines()[-15:]) for m in machines)


def _wait_line(m: Machine, prefix: str, timeout_s: float, machines: list[Machine]) -> dict[str, Any]:
    """The JSON of the first `PREFIX {json}` line on the machine's terminal (bounded wait)."""
    assert m.proc is not None
    deadline = time.monotonic() + timeout_s
    while True:
        for line in m.lines():
            if line.startswith(prefix + " "):
                data = json.loads(line[len(prefix) + 1:])
                assert isinstance(data, dict), line
                return data
        if m.proc.poll() is not None:
            pytest.fail(f"{m.name} exited ({m.proc.returncode}) before {prefix}\n{_tails(machines)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {prefix} from {m.name} within {timeout_s:.0f}s\n{_tails(machines)}")
        time.sleep(POLL_S)


def _start_swarm(machines: list[Machine], label: str, plan: Plan, extra: list[str],
                 env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Start every node as section 3 says, wave by wave; check READY and SERVING; the SERVING lines."""
    by_name = {m.name: m for m in machines}
    contacts, waves = plan
    ready: dict[str, dict[str, Any]] = {}
    serving: dict[str, dict[str, Any]] = {}
    for wave in waves:
        for name in wave:
            m = by_name[name]
            m.terminal = m.dir / f"terminal-{label}.txt"
            contact = by_name[contacts[name]] if name in contacts else None
            with m.terminal.open("wb") as term:
                m.proc = subprocess.Popen(_gwtf("node", *_node_flags(m, contact), *extra), cwd=m.dir, stdout=term,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)
            m.started.append(m.proc)
        for name in wave:
            ready[name] = _wait_line(by_name[name], "READY", 90, machines)
            serving[name] = _wait_line(by_name[name], "SERVING", 90, machines)
    for m in machines:  # what the doc says of READY and SERVING
        r, s = ready[m.name], serving[m.name]
        assert r["node"].startswith(f"{m.name}~") and r["node"].endswith(f"/local@{m.listen}"), r
        assert (r["host"], r["port"]) == (m.host, m.port), r
        assert (s["node"], s["name"]) == (r["node"], m.name), s
        if m.name.startswith("dh"):
            assert (s["role"], s["stage"], s["shard"]) == ("data-holder", 0, int(m.name[2:])), s
        else:
            assert (s["role"], s["shard"]) == ("relay", None) and s["stage"] in (1, 2), s
    assert ready["dh0"]["stage"] == 0 and ready["dh1"]["stage"] is None  # a joiner has no stage yet
    return serving


def _signal(proc: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    """Signal the node's process group (its own session)."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            proc.send_signal(sig)


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    """kill -9 of the node's process group (a crash), and reaped."""
    if proc is None:
        return
    _signal(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
        pass


def _last_stepped(m: Machine) -> int:
    return max((int(r["iteration"]) for r in m.records() if r.get("event") == "stepped"), default=-1)


def _wait_until_all_exit(machines: list[Machine], everyone: list[Machine], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(m.proc is not None and m.proc.poll() is None for m in machines):
        assert time.monotonic() < deadline, f"the run did not end within {timeout_s:.0f}s\n{_tails(everyone)}"
        time.sleep(POLL_S)
    codes = {m.name: m.proc.returncode if m.proc is not None else None for m in machines}
    assert codes == {m.name: 0 for m in machines}, f"{codes}\n{_tails(everyone)}"
    for m in machines:
        assert any("training finished (" in line for line in m.lines()), f"{m.name}:\n" + "\n".join(m.lines()[-20:])


def _audit(machines: list[Machine], folder: Path, set_flags: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Section 4: every machine's --out folder copied to one machine, `gwtf audit` on all of them."""
    for m in machines:
        shutil.copytree(m.dir / m.out, folder / m.out)
    shutil.copy(DEMO_CONFIG, folder / "swarm.toml")
    done = subprocess.run(_gwtf("audit", *(m.out for m in machines), "--config", "swarm.toml", *set_flags, "--json"),
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    assert summary["clean"] and summary["violations"] == [] and summary["dropped"] == 0, summary
    assert summary["nodes"] == sorted(NAMES) and summary["unhashed"] == 0, summary
    assert (summary["end"], summary["finished"]) == (ITERATIONS, True), summary
    # every microbatch of D = 2 data holders x M = 4 expected once at each of the 3 stages
    assert summary["expected"] == 2 * 4 * 3 * summary["audited"], summary
    assert summary["hashed"] == 3 * summary["audited"], summary
    return summary


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_multi_host_doc_on_loopback_addresses(tmp_path: Path) -> None:
    env = {**os.environ, "GWTF_PIP_INDEX_URL": os.environ.get("GWTF_PIP_INDEX_URL") or "none"}  # never the network
    env.pop("GWTF_SWARM_SECRET", None)  # the secret file is the one used
    machines: list[Machine] = []
    for i, name in enumerate(NAMES):
        host, letter = f"127.0.0.{i + 2}", "abcdef"[i]
        (tmp_path / letter).mkdir()
        machines.append(Machine(letter, name, host, _free_port(host), tmp_path / letter))
    a = machines[0]

    # 1. A shared secret, made on machine a and copied to every machine, private
    made = subprocess.run(_gwtf("secret", "new", "swarm.secret"), cwd=a.dir, env=env, capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert (a.dir / "swarm.secret").stat().st_mode & 0o777 == 0o600
    for m in machines[1:]:
        shutil.copy(a.dir / "swarm.secret", m.dir / "swarm.secret")
        os.chmod(m.dir / "swarm.secret", 0o600)

    # 2. The same config everywhere, the same --set flags on every node; the data holders' data
    for m in machines:
        shutil.copy(DEMO_CONFIG, m.dir / "swarm.toml")
    prepared = subprocess.run(_gwtf("data", "prepare", "shakespeare", "--config", "swarm.toml"), cwd=a.dir, env=env,
                              capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    sets = list(SETS)
    if prepared.stdout.startswith("data synthetic"):  # offline without a cached copy: the fallback, everywhere
        sets.append('data.source="synthetic"')
    set_flags = [x for s in sets for x in ("--set", s)]

    try:
        # 3. + 4. Start the nodes; kill -9 a relay while it trains; the others finish and exit 0
        for m in machines:
            m.out = f"runs/{m.letter}"
        serving = _start_swarm(machines, "run", FIRST_RUN, set_flags, env)
        stage_of = {m.name: serving[m.name]["stage"] for m in machines[2:]}
        replicas = {k: [n for n, s in stage_of.items() if s == k] for k in (1, 2)}
        assert all(replicas.values()), stage_of  # every relay stage has a replica
        victim = next(m for m in machines if m.name == max(replicas.values(), key=len)[-1])
        assert len(replicas[stage_of[victim.name]]) >= 2, stage_of  # and the victim's stage keeps one
        deadline = time.monotonic() + 120
        while _last_stepped(a) < KILL_AFTER - 1:
            assert all(m.proc is not None and m.proc.poll() is None for m in machines), _tails(machines)
            assert time.monotonic() < deadline, f"{_last_stepped(a) + 1} iterations in 120s\n{_tails(machines)}"
            time.sleep(POLL_S)
        _kill(victim.proc)
        killed_at = _last_stepped(a) + 1
        assert killed_at < ITERATIONS, killed_at  # the crash came mid-run
        assert victim.proc is not None and victim.proc.returncode == -signal.SIGKILL
        survivors = [m for m in machines if m is not victim]
        _wait_until_all_exit(survivors, machines, 150)
        assert any(f"member {victim.name} (stage {stage_of[victim.name]}) lost; " in line for line in a.lines()), \
            "\n".join(a.lines())
        assert sorted({int(r["iteration"]) for r in a.records() if r.get("event") == "stepped"}) == \
            list(range(ITERATIONS))
        for m in survivors:  # OUT/nodes/<name>/stdout.log has what the terminal showed
            assert any("training finished (" in line for line in m.log()), m.name

        # every data holder's own folder holds the final version of every stage (issue 44)
        for m in machines[:2]:
            over = [r for r in m.records() if r.get("event") == "training_over"]
            assert len(over) == 1 and over[0]["copies_missing"] == [], (m.name, over)
            assert newest_complete(m.dir / m.out / "checkpoints", 3) == ITERATIONS, m.name
        # Resuming the finished swarm (the doc's resume command of the first node): one line, exit 0
        resumed = subprocess.run(
            _gwtf("node", "--listen", a.listen, "--role", "data-holder", "--name", "dh0", "--out", a.out,
                  "--config", "swarm.toml", "--secret-file", "swarm.secret", "--resume", "--device", "cpu",
                  *set_flags),
            cwd=a.dir, env=env, capture_output=True, text=True, timeout=60, start_new_session=True,
        )
        said = (resumed.stdout + resumed.stderr).splitlines()
        assert resumed.returncode == 0 and len(said) == 1 and "the run is finished" in said[0], said
        first = _audit(machines, tmp_path / "gathered-run", set_flags, env)
        assert (first["first"], first["set_aside"], first["notes"]) == (0, 0, []), first

        # A stopped swarm resumed: a second run in fresh folders, kill -9 of every node once dh0's
        # checkpoints hold a version complete for all stages (its own and its copies of the relays'),
        # then the same nodes again with --resume, the first node first: the run finishes
        for m in machines:
            m.out = f"again/{m.letter}"
        _start_swarm(machines, "again", SECOND_RUN, set_flags, env)
        deadline = time.monotonic() + 120
        while (newest_complete(a.dir / a.out / "checkpoints", 3, warn=lambda _: None) or 0) < EVERY:
            assert all(m.proc is not None and m.proc.poll() is None for m in machines), _tails(machines)
            assert time.monotonic() < deadline, f"no checkpoint on dh0 within 120s\n{_tails(machines)}"
            time.sleep(POLL_S)
        for m in machines:  # every node at once, then reaped
            _signal(m.proc, signal.SIGKILL)
        for m in machines:
            _kill(m.proc)
        assert all(m.proc is not None and m.proc.returncode == -signal.SIGKILL for m in machines)
        version = newest_complete(a.dir / a.out / "checkpoints", 3)
        assert version is not None and EVERY <= version < ITERATIONS and version % EVERY == 0, version
        _start_swarm(machines, "resumed", RESUMED, [*set_flags, "--resume"], env)
        assert f"gwtf node dh0: resuming from checkpoint version {version}" in a.lines(), "\n".join(a.lines())
        _wait_until_all_exit(machines, machines, 150)
        again = _audit(machines, tmp_path / "gathered-again", set_flags, env)
        assert again["first"] == version and again["set_aside"] > 0, again  # the killed start is set aside
        assert len(again["notes"]) == 1 and "set aside" in again["notes"][0], again
        print(f"relay {victim.name} (stage {stage_of[victim.name]}) killed after {killed_at} iterations; "
              f"every node killed and resumed at version {version}")
    finally:
        for m in machines:
            for proc in m.started:
                _kill(proc)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_every_data_holder_machine_lost_two_new_machines_restore_stage_0_from_a_relays_copy(tmp_path: Path) -> None:
    """docs/multi-host.md "Losing every data holder" (issue 42: no class of node holds the only
    copies of a stage): the doc's six machines, then both data holders' machines killed at once
    (kill -9) once a relay's own folder holds a copy of stage 0's checkpoint. A relay leads and
    pauses (stage 0 lost); two new machines with empty folders join through a relay as data
    holders of the two vacant shards. Their own disks have no stage 0: they fetch it from a
    relay's copy (`checkpoint_fetched`, source a relay), the swarm rolls back to that version and
    finishes; every survivor and joiner exits 0 and the gathered folders' audit is clean."""
    env = {**os.environ, "GWTF_PIP_INDEX_URL": os.environ.get("GWTF_PIP_INDEX_URL") or "none"}
    env.pop("GWTF_SWARM_SECRET", None)
    names = (*NAMES, "nd0", "nd1")  # the two new data-holder machines, shards 0 and 1
    machines: list[Machine] = []
    for i, name in enumerate(names):
        host, letter = f"127.0.0.{i + 2}", "abcdefgh"[i]
        (tmp_path / letter).mkdir()
        machines.append(Machine(letter, name, host, _free_port(host), tmp_path / letter))
        shutil.copy(DEMO_CONFIG, tmp_path / letter / "swarm.toml")
        machines[-1].out = f"runs/{letter}"
    first, new = machines[:6], machines[6:]
    made = subprocess.run(_gwtf("secret", "new", "swarm.secret"), cwd=first[0].dir, env=env, capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    for m in machines[1:]:
        shutil.copy(first[0].dir / "swarm.secret", m.dir / "swarm.secret")
        os.chmod(m.dir / "swarm.secret", 0o600)
    sets = [*SETS, 'data.source="synthetic"']  # every machine agrees on the data without a download
    set_flags = [x for s in sets for x in ("--set", s)]
    relays = first[2:]
    try:
        _start_swarm(first, "run", FIRST_RUN, set_flags, env)
        deadline = time.monotonic() + 120

        def relay_copy() -> int:
            return max((v for m in relays for v in checkpoints.versions(m.dir / m.out / "checkpoints", 0)), default=0)

        while relay_copy() < EVERY:
            assert all(m.proc is not None and m.proc.poll() is None for m in first), _tails(first)
            assert time.monotonic() < deadline, f"no relay holds stage 0 within 120s\n{_tails(first)}"
            time.sleep(POLL_S)
        for m in first[:2]:  # both data holders' machines at once
            _signal(m.proc, signal.SIGKILL)
        for m in first[:2]:
            _kill(m.proc)
        contact = relays[0]
        for m in new:
            m.terminal = m.dir / "terminal-run.txt"
            flags = ["--listen", m.listen, "--join", contact.listen, "--role", "data-holder", "--shard", m.name[2:],
                     "--name", m.name, "--config", "swarm.toml", "--secret-file", "swarm.secret", "--out", m.out,
                     "--device", "cpu"]
            with m.terminal.open("wb") as term:
                m.proc = subprocess.Popen(_gwtf("node", *flags, *set_flags), cwd=m.dir, stdout=term,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)
            m.started.append(m.proc)
        _wait_until_all_exit([*relays, *new], machines, 180)
        fetched = [r for m in new for r in m.records() if r.get("event") == "checkpoint_fetched"]
        relay_ids = {json.loads(line[len("READY "):])["node"] for m in relays for line in m.lines()
                     if line.startswith("READY ")}
        assert fetched and all(r["stage"] == 0 and r["source"] in relay_ids for r in fetched), fetched
        assert all(checkpoints.versions(m.dir / m.out / "checkpoints", 0) for m in new)
        folder = tmp_path / "gathered"
        for m in machines:
            shutil.copytree(m.dir / m.out, folder / m.out)
        shutil.copy(DEMO_CONFIG, folder / "swarm.toml")
        done = subprocess.run(_gwtf("audit", *(m.out for m in machines), "--config", "swarm.toml", *set_flags,
                                    "--json"), cwd=folder, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        summary = json.loads(done.stdout)
        assert summary["clean"] and summary["violations"] == [] and summary["finished"], summary
        assert summary["end"] == ITERATIONS, summary
        print(f"stage 0 fetched from a relay's copy: {fetched}")
    finally:
        for m in machines:
            for proc in m.started:
                _kill(proc)
