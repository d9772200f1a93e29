"""Swarm stage checkpoints: sha256 per file verified on load, fall-back to the previous complete
version when the newest is missing, truncated or modified, and pruning that keeps it.

Uses a real `Host` (tiny model of configs/swarm-test.toml, CPU) so the bytes are real stage state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gwtf.config import Config, load_config
from gwtf.errors import UserError
from gwtf.runtime import checkpoints
from gwtf.runtime.drive import Host
from gwtf.runtime.node import NodeIdentity
from gwtf.runtime.worker import StageWorker

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")
EVERY = 5


def _cfg() -> Config:
    return load_config(CONFIG, ["model.stages=3", f"protocol.checkpoint_every={EVERY}", "train.iterations=30"])


def _host(out: Path, resume: bool = False) -> Host:
    ident = NodeIdentity(name="r1a", role="relay", stage=1, region="local", shard=None, listen="127.0.0.1:0",
                         join=None, device="cpu", out_dir=out, resume=resume)
    return Host.create(_cfg(), ident, "r1a/local@127.0.0.1:1")


def _write_versions(out: Path, versions: tuple[int, ...]) -> dict[int, str]:
    """Every stage writes each version (weights nudged between them); stage 1's hash per version."""
    host = _host(out)
    assert host.worker is not None
    workers: list[StageWorker] = [host._make_worker(k) for k in range(3)]
    hashes = {}
    for v in versions:
        for w in workers:
            with torch.no_grad():
                for p in w.module.parameters():
                    p.add_(0.01)
            host._save_checkpoint(w, v)
        hashes[v] = workers[1].weights_hash()
    return hashes


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [_flip_bit, _truncate, _delete], ids=["flipped-bit", "truncated", "missing"])
@pytest.mark.parametrize("stage", [1, 2])
def test_resume_falls_back_to_the_previous_complete_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], stage: int
) -> None:
    hashes = _write_versions(tmp_path, (5, 10))
    bad = tmp_path / "checkpoints" / f"stage{stage}" / "v10.safetensors"
    damage(bad)
    with caplog.at_level(logging.WARNING, logger="gwtf.checkpoints"):
        host = _host(tmp_path, resume=True)
    assert host.core.start_version == 5
    assert host.worker is not None and host.worker.weights_hash() == hashes[5]
    assert str(bad) in caplog.text


def test_resume_takes_the_newest_complete_version(tmp_path: Path) -> None:
    hashes = _write_versions(tmp_path, (5, 10))
    host = _host(tmp_path, resume=True)
    assert host.core.start_version == 10
    assert host.worker is not None and host.worker.weights_hash() == hashes[10]


def test_a_flipped_bit_is_refused_on_load(tmp_path: Path) -> None:
    """Loading a named version (rollback, joiner) verifies it instead of loading silently."""
    _write_versions(tmp_path, (5,))
    bad = tmp_path / "checkpoints" / "stage1" / "v5.safetensors"
    _flip_bit(bad)
    host = _host(tmp_path)
    assert host.worker is not None
    with pytest.raises(checkpoints.CheckpointError, match=r"stage1/v5\.safetensors: sha256 mismatch"):
        host._load_checkpoint(host.worker, ("state", 1, 5, "checkpoint"))


def test_a_version_missing_for_one_stage_is_not_complete(tmp_path: Path) -> None:
    """Killed mid-save: stage 2 never wrote v10 (only a temp file) -> v5 for everyone."""
    _write_versions(tmp_path, (5, 10))
    folder = tmp_path / "checkpoints" / "stage2"
    (folder / "v10.safetensors").rename(folder / f".v10.safetensors.{12345}.tmp")
    (folder / "v10.json").unlink()
    assert checkpoints.newest_complete(tmp_path / "checkpoints", 3) == 5


def test_pruning_keeps_the_previous_complete_version(tmp_path: Path) -> None:
    _write_versions(tmp_path, (5, 10, 15))
    folder = tmp_path / "checkpoints" / "stage1"
    assert sorted(p.name for p in folder.iterdir()) == ["v10.json", "v10.safetensors", "v15.json", "v15.safetensors"]
    _truncate(folder / "v15.safetensors")  # newest damaged: the next save keeps the last good one
    _write_versions_stage1(tmp_path, 20)
    assert checkpoints.versions(tmp_path / "checkpoints", 1) == [20, 15, 10]


def _write_versions_stage1(out: Path, version: int) -> None:
    host = _host(out)
    assert host.worker is not None
    host._save_checkpoint(host.worker, version)


def test_nothing_to_resume_from_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="nothing to resume from: .*checkpoints has no checkpoint complete for all 3"):
        _host(tmp_path, resume=True)
    _write_versions(tmp_path, (5,))
    _flip_bit(tmp_path / "checkpoints" / "stage0" / "v5.safetensors")
    # issue 44: the error names which stage lacks which version
    with pytest.raises(UserError, match=r"nothing to resume from: .*\(stage 0: none; stage 1: v5; stage 2: v5\)"):
        _host(tmp_path, resume=True)


def test_resuming_a_finished_run_says_so_and_is_not_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """issue 44: the run's last version is on disk for every stage: nothing to resume, exit 0."""
    from gwtf import cli
    from gwtf.errors import NothingToDo

    _write_versions(tmp_path, (5,))
    with pytest.raises(NothingToDo, match="the run is finished: every stage's checkpoint .* is at version 5"):
        checkpoints.resume_version(tmp_path / "checkpoints", 3, 5, 5)
    assert checkpoints.resume_version(tmp_path / "checkpoints", 3, 10, 5) == 5  # raise --iterations: trains on
    (tmp_path / "nodes" / "dh0").mkdir(parents=True)
    (tmp_path / "nodes" / "dh0" / "records.jsonl").write_text("{}\n")
    code = cli.main(["swarm", "--config", str(CONFIG), "--set", "model.stages=3", "--out", str(tmp_path),
                     "--resume", "--iterations", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and len(err) == 1 and "the run is finished" in err[0], (code, err)


def test_resuming_a_finished_run_without_its_final_copies_names_them(tmp_path: Path) -> None:
    """A data holder whose final copy of a relay stage never came (a loaded box: its bounded wait
    ran out) used to resume from the older complete version and wait for good for nodes of a run
    that was over: its records say the run ended, so it is an error naming the stage instead."""
    _write_versions(tmp_path, (5, 10))
    for name in ("v10.safetensors", "v10.json"):
        (tmp_path / "checkpoints" / "stage2" / name).unlink()
    records = tmp_path / "nodes" / "dh0" / "records.jsonl"
    records.parent.mkdir(parents=True)
    assert checkpoints.training_ended(records) is None  # no records: the node never saw the end
    records.write_text('{"event": "stepped", "iteration": 9}\n{"event": "training_over", "version": 10, '
                       '"copies_missing": [2]}\n{"event": "trai')  # the last line cut by a crash
    assert checkpoints.training_ended(records) == 10
    with pytest.raises(UserError, match=r"the run finished at version 10, but .* lacks that version of stage\(s\) 2 "):
        checkpoints.resume_version(tmp_path / "checkpoints", 3, 10, 5, ended=10)
    # a run stopped before its end resumes from what is complete, whatever the records say
    assert checkpoints.resume_version(tmp_path / "checkpoints", 3, 10, 5, ended=None) == 5
    assert checkpoints.resume_version(tmp_path / "checkpoints", 3, 20, 5, ended=10) == 5  # trains on to 20
