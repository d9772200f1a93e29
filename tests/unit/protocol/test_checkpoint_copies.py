"""Data holders keep the newest checkpoint of every relay stage, and a joiner restoring a lost
stage fetches it from one (docs/protocol.md, "Whole stage lost"): on several hosts the joiner's
own disk has no copy of a stage it never served.

Checked at the core boundary (the sends and computes NodeCore emits): at each checkpoint version
the data holders are dealt over the stage's replicas, one copy each; a joiner of a lost stage
asks a data holder (another one after a deadline or a refusal), and its own disk only when none
has it; with `protocol.checkpoint_replicate = false` nothing of this is sent.
"""

from __future__ import annotations

import random
from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.config import ProtocolConfig
from gwtf.protocol import messages as m
from gwtf.protocol.base import Send
from gwtf.protocol.core import NodeCore
from gwtf.protocol.router import PeerInfo

EVERY = 2


def _ckpt_sends(h: Harness) -> list[tuple[str, str, m.StateTransfer]]:
    return [(src, dst, msg) for src, dst, msg in h.sent
            if isinstance(msg, m.StateTransfer) and msg.key[:1] == ("ckpt",)]


def _swarm(replicate: bool = True, iterations: int = 5, stage0_copies: int = 0, sizes: tuple[int, ...] = (2, 2, 1),
           max_dhs: int = 2) -> Harness:
    cfg = ProtocolConfig(checkpoint_every=EVERY, checkpoint_replicate=replicate, stage0_copies=stage0_copies,
                         stage0_copies_max_dhs=max_dhs)
    h = Harness(peers(sizes), replace(TRAIN, iterations=iterations, data_holders=sizes[0]), cfg=cfg)
    h.start()
    return h


def test_each_data_holder_gets_one_copy_of_every_relay_stage_per_checkpoint() -> None:
    h = _swarm()
    h.run(60.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done"), "the swarm did not finish"
    got = sorted((dst, msg.stage, msg.version, src) for src, dst, msg in _ckpt_sends(h))
    # stage 1 (a0, a1) deals d0 to a0 and d1 to a1; stage 2 has b0 only, which sends both
    expected = sorted((d, k, v, src) for v in (2, 4)
                      for d, k, src in (("d0", 1, "a0"), ("d1", 1, "a1"), ("d0", 2, "b0"), ("d1", 2, "b0")))
    assert got == expected
    assert all(msg.key == ("ckpt", msg.stage, msg.version, src) and msg.size_bytes == TRAIN.stage_state_bytes[2]
               for src, _, msg in _ckpt_sends(h))
    stored = sorted((n, c.inputs[0]) for n, c in h.computes if c.kind == "store_checkpoint")
    assert stored == sorted((dst, msg.key) for _, dst, msg in _ckpt_sends(h))
    for node in ("a0", "a1", "b0"):  # each export right after the step that made its version (FIFO)
        kinds = [c.kind for n, c in h.computes if n == node]
        at = [i for i, k in enumerate(kinds) if k == "export_checkpoint"]
        assert len(at) == 2 and all(kinds[i - 1] == "step" for i in at), kinds


def test_no_copies_when_replication_is_off() -> None:
    h = _swarm(replicate=False)
    h.run(60.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done")
    assert _ckpt_sends(h) == []
    assert not [c for _, c in h.computes if c.kind in ("export_checkpoint", "store_checkpoint")]


def test_a_joiner_of_a_lost_stage_restores_it_from_a_data_holder() -> None:
    h = _swarm(iterations=8)
    h.run(60.0, stop=lambda: any(f["iteration"] == 3 for f in h.events("iteration_done")))
    h.crash("b0")  # the only replica of stage 2: the stage is lost after checkpoint 2 (or 4)
    h.run(h.now + 30.0, stop=lambda: bool(h.events("stage_lost")))
    assert h.events("stage_lost")
    # d0 never answers a checkpoint request: the joiner asks d1 after the state deadline
    h.drop = lambda src, dst, msg: dst == "d0" and isinstance(msg, m.StateRequest)
    joiner = NodeCore(PeerInfo(id="j", stage=-1, region="r", compute_s=0.1, capacity=4), h.cfg, h.train,
                      random.Random(1))
    h.cores["j"] = joiner
    h.apply("j", joiner.on_start(h.now, [PeerInfo(id="d1", stage=-1, region="r", compute_s=0.1, capacity=1)]))
    h.run(h.now + 120.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done"), "the swarm did not go on after the restore"
    asks = [(dst, msg) for src, dst, msg in h.sent if src == "j" and isinstance(msg, m.StateRequest)]
    lost = h.events("stage_lost")[0]["iteration"]
    version = lost // EVERY * EVERY
    assert [(d, a.stage, a.checkpoint) for d, a in asks] == [("d0", 2, version), ("d1", 2, version)]
    assert h.events("checkpoint_fetched") == [{"node": "j", "stage": 2, "version": version, "source": "d1"}]
    assert [c.outputs for n, c in h.computes if c.kind == "read_checkpoint"] == [(("ckpt", 2, version, "d1"),)]
    mine = [c.kind for n, c in h.computes if n == "j"]
    assert mine[0] == "import_state", mine  # the data holder's copy, not the joiner's own disk
    rollbacks = h.events("rollback")
    assert rollbacks and rollbacks[-1]["version"] == version
    assert (rollbacks[-1]["lost_from"], rollbacks[-1]["lost_iterations"]) == (lost, lost - version)


def _welcomed_joiner(replicate: bool, checkpoint: int) -> tuple[NodeCore, list[object]]:
    """A joiner that was just welcomed to stage 2, which has no replica (d0 and d1 are members)."""
    cfg = ProtocolConfig(checkpoint_every=EVERY, checkpoint_replicate=replicate)
    j = NodeCore(PeerInfo(id="j", stage=-1, region="r", compute_s=0.1, capacity=4), cfg, TRAIN, random.Random(1))
    j.on_start(0.0, [PeerInfo(id="d0", stage=-1, region="r", compute_s=0.1, capacity=1)])
    members = (("d0", 0, "r", 0.1, 4, 2, 0), ("d1", 0, "r", 0.1, 4, 2, 1), ("a0", 1, "r", 0.1, 4, 0, -1))
    welcome = m.Welcome(term=0, stage=2, members=members, utilisation=(1.0, 1.0, 1e9), iteration=3,
                        checkpoint_iteration=checkpoint)
    return j, j.on_message("d0", welcome, 0.1)


def _asked(out: list[object]) -> list[tuple[str, int, int]]:
    return [(e.to, e.msg.stage, e.msg.checkpoint) for e in out
            if isinstance(e, Send) and isinstance(e.msg, m.StateRequest)]


def _loads(out: list[object]) -> list[m.Compute]:
    return [e for e in out if isinstance(e, m.Compute) and e.kind == "load_checkpoint"]


def test_every_data_holder_refusing_leaves_the_joiner_its_own_disk() -> None:
    j, out = _welcomed_joiner(True, 2)
    assert _asked(out) == [("d0", 2, 2)] and not _loads(out)
    refusal = m.StateTransfer(stage=2, version=-1, key=(), ok=False)
    out = j.on_message("d0", refusal, 0.2)
    assert _asked(out) == [("d1", 2, 2)] and not _loads(out)
    out = j.on_message("d1", refusal, 0.3)
    assert _asked(out) == [] and [c.outputs for c in _loads(out)] == [(("state", 2, 2, "checkpoint"),)]


def test_without_replication_or_at_version_0_the_joiner_loads_its_own_disk() -> None:
    for replicate, version in ((False, 2), (True, 0)):
        _, out = _welcomed_joiner(replicate, version)
        assert _asked(out) == [] and len(_loads(out)) == 1, (replicate, version)


def test_a_data_holder_answers_a_checkpoint_request_from_disk_and_refuses_when_it_cannot() -> None:
    h = _swarm(iterations=50)
    h.run(1.0)
    dh = h.cores["d1"]
    out = dh.on_message("j", m.StateRequest(stage=2, checkpoint=2), h.now)
    (read,) = [e for e in out if isinstance(e, m.Compute)]
    assert read.kind == "read_checkpoint" and read.stage == 0 and read.outputs == (("ckpt", 2, 2, "d1"),)
    (sent,) = [e.msg for e in dh.on_compute_done(read.job_id, h.now) if isinstance(e, Send) and e.to == "j"]
    assert isinstance(sent, m.StateTransfer) and sent.ok and sent.key == ("ckpt", 2, 2, "d1")
    assert sent.version == 2 and sent.size_bytes == TRAIN.stage_state_bytes[2]
    out = dh.on_message("j", m.StateRequest(stage=2, checkpoint=2), h.now)
    (read,) = [e for e in out if isinstance(e, m.Compute)]
    failed = dh.on_compute_failed(read.job_id, "CheckpointError: v2.json: manifest missing", h.now)
    assert dh.alive, "a missing copy must not stop the data holder"
    assert [e.msg.ok for e in failed if isinstance(e, Send) and e.to == "j"] == [False]
    relay = h.cores["a0"]  # a relay holds no copies of other stages: it refuses
    (no,) = [e.msg for e in relay.on_message("j", m.StateRequest(stage=2, checkpoint=2), h.now)
             if isinstance(e, Send)]
    assert isinstance(no, m.StateTransfer) and not no.ok


def test_the_rollback_goes_no_later_than_the_state_a_restored_stage_holds() -> None:
    """Run 5 of the integration loop: stage 1's last replica died after step 65 but before its
    checkpoint 65 existed (it was exporting its state to a joiner); the joiner restored
    checkpoint 60 from a data holder, yet the leader rolled back to 65, which the joiner then
    failed to load (exit 5). The rollback must not pass the version a restored stage holds."""
    h = _swarm(iterations=12)
    h.run(60.0, stop=lambda: any(f["iteration"] == 5 for f in h.events("iteration_done")))
    h.crash("b0")  # stage 2's only replica
    h.run(h.now + 30.0, stop=lambda: bool(h.events("stage_lost")))
    lost_from = h.events("stage_lost")[0]["iteration"]
    newest = lost_from // EVERY * EVERY
    assert newest >= 2 * EVERY, lost_from
    held = newest - EVERY  # the only copy of stage 2 the joiner could get
    joiner = NodeCore(PeerInfo(id="j", stage=2, region="r", compute_s=0.1, capacity=4), h.cfg, h.train,
                      random.Random(1))
    h.cores["j"] = joiner
    ready = m.Ready(stage=2, version=held, peer=("j", 2, "r", 0.1, 4, 0, -1))
    h.apply("d0", h.cores["d0"].on_message("j", ready, h.now))
    rollbacks = h.events("rollback")
    assert rollbacks and rollbacks[-1]["version"] == held, (rollbacks, newest)


def test_a_node_already_at_the_rollback_version_loads_nothing() -> None:
    h = _swarm(iterations=8)
    h.run(60.0, stop=lambda: any(f["iteration"] == 2 for f in h.events("iteration_done")))
    relay = h.cores["a0"]
    at = relay.version
    out = relay.on_message("d0", m.Rollback(term=relay.term, version=at, lost_from=at), h.now)
    assert not [e for e in out if isinstance(e, m.Compute) and e.kind == "load_checkpoint"]
    assert relay.version == at
    out = relay.on_message("d0", m.Rollback(term=relay.term, version=at - 1, lost_from=at), h.now)
    assert [e.kind for e in out if isinstance(e, m.Compute)] == ["load_checkpoint"]


def test_a_checkpoint_the_joiners_disk_cannot_load_falls_back_to_the_previous_one() -> None:
    """The stage's last replica died while writing checkpoint 4 (blob, no manifest) and before
    any data holder got a copy: the joiner's load of 4 fails. It asks for checkpoint 2 (the
    data holders first, then its disk), and so on down to the initial model (version 0), whose
    failure stops it with a reason; never the same failing load again (it spun on it)."""
    j, out = _welcomed_joiner(True, 4)
    refusal = m.StateTransfer(stage=2, version=-1, key=(), ok=False)
    t = 0.2
    for version in (4, 2):
        assert _asked(out) == [("d0", 2, version)] and not _loads(out)
        out = j.on_message("d0", refusal, t)
        out = j.on_message("d1", refusal, t + 0.1)
        loads = _loads(out)
        assert [c.outputs for c in loads] == [(("state", 2, version, "checkpoint"),)]
        out = j.on_compute_failed(loads[0].job_id, "CheckpointError: manifest missing", t + 0.2)
        fallback = [dict(e.fields) for e in out if isinstance(e, m.Record) and e.event == "checkpoint_fallback"]
        assert fallback == [{"node": "j", "stage": 2, "failed": version, "version": version - EVERY}]
        t += 1.0
    # version 0 is not asked of the data holders: it is the initial model, loaded in place
    loads = _loads(out)
    assert _asked(out) == [] and [c.outputs for c in loads] == [(("state", 2, 0, "checkpoint"),)]
    out = j.on_compute_failed(loads[0].job_id, "RuntimeError: out of memory", t)
    stops = [dict(e.fields) for e in out if isinstance(e, m.Record) and e.event == "self_stop"]
    assert stops == [{"node": "j", "reason": "compute_failed"}] and not j.alive
    assert not _loads(out) and not _asked(out)


def test_while_few_data_holders_live_stage_0_goes_to_the_first_replica_of_each_relay_stage() -> None:
    """No class of node holds the only copies of a stage (issue 42): with at most
    `stage0_copies_max_dhs` data holders, each checkpoint of stage 0 also goes to relays, the
    lowest-id replica of stage 1 and of stage 2, dealt over the data holders like the relay
    stages' copies (d0 -> a0, d1 -> b0); a relay keeps it (store_checkpoint)."""
    h = _swarm(stage0_copies=2)
    h.run(60.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done")
    got = sorted((dst, msg.version, src) for src, dst, msg in _ckpt_sends(h) if msg.stage == 0)
    assert got == sorted((dst, v, src) for v in (2, 4) for dst, src in (("a0", "d0"), ("b0", "d1")))
    assert all(msg.size_bytes == TRAIN.stage_state_bytes[0] for _, _, msg in _ckpt_sends(h) if msg.stage == 0)
    stored = sorted((n, c.inputs[0]) for n, c in h.computes if c.kind == "store_checkpoint" and c.inputs[0][1] == 0)
    assert stored == sorted((dst, msg.key) for _, dst, msg in _ckpt_sends(h) if msg.stage == 0)
    # one copy only: the first holder
    h = _swarm(stage0_copies=1)
    h.run(60.0, stop=lambda: bool(h.events("training_done")))
    assert sorted((dst, src) for src, dst, msg in _ckpt_sends(h) if msg.stage == 0) == [("a0", "d0")] * 2


def test_with_more_data_holders_live_than_the_bound_stage_0_is_not_copied() -> None:
    h = _swarm(stage0_copies=2, sizes=(3, 2, 1), max_dhs=2)
    h.run(60.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done")
    assert [msg for _, _, msg in _ckpt_sends(h) if msg.stage == 0] == []
    assert {msg.stage for _, _, msg in _ckpt_sends(h)} == {1, 2}  # the relay stages' copies as before


def test_every_data_holder_lost_a_joiner_restores_stage_0_from_a_relays_copy() -> None:
    """Both data holders crash at once after checkpoint 4: a relay leads and pauses (stage 0
    lost); a joiner is given stage 0, asks the relays for the checkpoint in holder order (a0
    first: it stored it) and imports it over the wire, not from its own disk (on machines of
    their own it has none); the swarm rolls back to 4 and finishes."""
    h = _swarm(iterations=8, stage0_copies=2)
    h.run(60.0, stop=lambda: any(f["iteration"] == 4 for f in h.events("iteration_done")))
    h.crash("d0")
    h.crash("d1")
    h.run(h.now + 60.0, stop=lambda: bool(h.events("stage_lost")))
    assert h.events("stage_lost")
    joiner = NodeCore(PeerInfo(id="j", stage=-1, region="r", compute_s=0.1, capacity=4), h.cfg, h.train,
                      random.Random(1))
    h.cores["j"] = joiner
    h.apply("j", joiner.on_start(h.now, [PeerInfo(id="a1", stage=-1, region="r", compute_s=0.1, capacity=1)]))
    h.run(h.now + 200.0, stop=lambda: bool(h.events("training_done")))
    assert h.events("training_done"), "the swarm did not go on after the restore"
    asks = [(dst, msg.stage, msg.checkpoint) for src, dst, msg in h.sent if src == "j" and isinstance(msg, m.StateRequest)]
    assert asks == [("a0", 0, 4)], asks
    assert h.events("checkpoint_fetched") == [{"node": "j", "stage": 0, "version": 4, "source": "a0"}]
    assert [c.kind for n, c in h.computes if n == "j"][0] == "import_state"  # not its own disk
    assert h.events("rollback")[-1]["version"] == 4


def test_a_relay_refuses_a_stage_0_request_for_a_version_it_did_not_store() -> None:
    h = _swarm(iterations=50, stage0_copies=2)
    h.run(1.0)
    out = h.cores["a1"].on_message("j", m.StateRequest(stage=0, checkpoint=2), h.now)
    (sent,) = [e.msg for e in out if isinstance(e, Send)]
    assert isinstance(sent, m.StateTransfer) and not sent.ok
    out = h.cores["a0"].on_message("j", m.StateRequest(stage=1, checkpoint=2), h.now)  # a relay serves no relay stage
    (sent,) = [e.msg for e in out if isinstance(e, Send)]
    assert isinstance(sent, m.StateTransfer) and not sent.ok
