"""benchmarks/headline.py's grid: enumeration and filters, the resumable JSONL cache, the per-cell
summary (paired seeds, fraction of the optimum, gwtf's reduction), the markdown table, the
heat-map, and the optimum replay's router. No simulator run: `run_one` is replaced where main runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gwtf.protocol.messages import NONE
from gwtf.protocol.router import LinkEstimate, PeerInfo

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "headline.py"


@pytest.fixture(scope="module")
def hl() -> ModuleType:
    spec = importlib.util.spec_from_file_location("headline_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["headline_bench"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _row(hl: ModuleType, cell: Any, seed: int, system: str, time_s: float, tput: float, **kw: Any) -> dict[str, Any]:
    job = hl.Job(cell, seed, system, 120)
    row = {"key": job.key(), "family": cell.family, "churn": cell.churn, "regime": cell.regime, "mix": cell.mix,
           "seed": seed, "system": system, "training_time_s": time_s, "throughput_mb_per_s": tput,
           "finished": True, "discarded": 0.0, "violations": 0, "wall_s": 0.0}
    row.update(kw)
    return row


# ---- enumeration ---------------------------------------------------------------------------


def test_full_grid_has_every_documented_cell_once(hl: ModuleType) -> None:
    cells = hl.grid_cells()
    assert len(cells) == 2 * 4 * 3 * 3 == len(set(cells))
    assert {c.churn for c in cells} == {"0", "0.33", "1", "2"}
    assert {c.regime for c in cells} == {"shipped", "bf16", "compute"}
    assert {c.mix for c in cells} == {"uniform", "default", "half-slow"}
    jobs = hl.grid_jobs(cells, seeds=5, iterations=120)
    # 3 systems per (cell, seed), one churn-free optimum per (family, regime, mix, seed)
    assert len(jobs) == 72 * 5 * 3 + 18 * 5
    assert len({j.key() for j in jobs}) == len(jobs)
    opt = [j for j in jobs if j.system == hl.OPTIMUM]
    assert {j.cell.churn for j in opt} == {"0"}
    assert {j.system for j in jobs} == {"gwtf", "swarm-released", "swarm", hl.OPTIMUM}


def test_filters_keep_a_subset_and_share_the_optimum(hl: ModuleType) -> None:
    cells = hl.grid_cells(["gpt"], ["0", "2"], ["shipped"], ["default"])
    assert [c.name for c in cells] == ["gpt/c0/shipped/default", "gpt/c2/shipped/default"]
    jobs = hl.grid_jobs(cells, seeds=2, iterations=10)
    assert len(jobs) == 2 * 2 * 3 + 2  # both churn levels share the seed's one optimum replay
    assert [c.name for c in hl.grid_cells(patterns=["llama/c1/*/half-slow"])] == [
        "llama/c1/shipped/half-slow", "llama/c1/bf16/half-slow", "llama/c1/compute/half-slow"]
    with pytest.raises(SystemExit, match="unknown churn 0.5"):
        hl.grid_cells(churn=["0.5"])


def test_overrides_set_the_documented_knobs(hl: ModuleType) -> None:
    job = hl.Job(hl.Cell("llama", "1", "bf16", "half-slow"), 3, "swarm", 50, ("sim.max_time_s=9",))
    ov = job.overrides()
    for want in ('model.family="llama"', 'nodes.gpu_mix="half-slow"', "churn.crash_rate_per_hour=1.0",
                 "churn.leave_rate_per_hour=0.2", f"churn.join_rate_per_hour={24 * 1.2}",
                 'wire.activations="bf16"', 'protocol.reduce="butterfly"', "train.iterations=50"):
        assert want in ov
    assert ov[-1] == "sim.max_time_s=9"  # the user's --set comes last, so it wins
    from gwtf.sim.scenario import load_scenario

    sc = load_scenario(None, hl.Job(hl.Cell("gpt", "0", "compute", "uniform"), 0, "gwtf", 5).overrides())
    assert sc.nodes.gpu_flops_scale < 1 < sc.nodes.link_bandwidth_scale
    assert sc.churn.crash_rate_per_hour == 0.0


# ---- cache ---------------------------------------------------------------------------------


def test_cache_key_changes_with_everything_that_defines_a_run(hl: ModuleType) -> None:
    cell = hl.Cell("gpt", "0.33", "shipped", "default")
    base = hl.Job(cell, 0, "gwtf", 120)
    assert base.key() == hl.Job(cell, 0, "gwtf", 120, plot_dir="x").key()  # plotting does not
    others = [hl.Job(cell, 1, "gwtf", 120), hl.Job(cell, 0, "swarm", 120), hl.Job(cell, 0, "gwtf", 40),
              hl.Job(cell, 0, "gwtf", 120, ("protocol.rebalance_period_s=0",)),
              hl.Job(hl.Cell("gpt", "1", "shipped", "default"), 0, "gwtf", 120)]
    assert len({base.key(), *(j.key() for j in others)}) == 1 + len(others)


def test_cache_roundtrip_skips_done_runs_and_a_torn_line(hl: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    cells = hl.grid_cells(["gpt"], ["0"], ["shipped"], ["uniform"])
    jobs = hl.grid_jobs(cells, seeds=1, iterations=5)
    assert len(jobs) == 4
    hl.append_cache(path, jobs[0].key(), {"a": 1, "plot": object()})  # plot data is never written
    hl.append_cache(path, jobs[1].key(), {"a": 2})
    with path.open("a", encoding="utf-8") as f:
        f.write('{"key": "' + jobs[2].key() + '", "row": {"a"')  # a write cut short
    cache = hl.read_cache(path)
    assert cache == {jobs[0].key(): {"a": 1}, jobs[1].key(): {"a": 2}}
    assert hl.pending(jobs, cache) == jobs[2:]
    assert hl.read_cache(tmp_path / "missing.jsonl") == {}


def test_main_resumes_from_the_cache(hl: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def fake_run(job: Any) -> dict[str, Any]:
        ran.append(job.key())
        t = {"gwtf": 90.0, "swarm-released": 100.0, "swarm": 120.0, hl.OPTIMUM: 80.0}[job.system]
        return _row(hl, job.cell, job.seed, job.system, t, 100.0 / t)

    monkeypatch.setattr(hl, "run_one", fake_run)
    cache, table = tmp_path / "runs.jsonl", tmp_path / "table.md"
    argv = ["--family", "gpt", "--churn", "0,2", "--regime", "shipped", "--mix", "default", "--seeds", "2",
            "--iterations", "5", "--jobs", "1", "--cache", str(cache), "--table-out", str(table)]
    assert hl.main(argv) == 0
    assert len(ran) == 2 * 2 * 3 + 2 and len(set(ran)) == len(ran)
    assert len(cache.read_text().splitlines()) == len(ran)
    first = table.read_text()
    ran.clear()
    assert hl.main(argv) == 0
    assert ran == []  # everything came from the cache
    assert table.read_text() == first
    assert "14 in the cache, 0 to run" in capsys.readouterr().out
    # one more seed: only its runs execute
    assert hl.main([*argv, "--seeds", "3"]) == 0  # the last --seeds wins
    assert len(ran) == 2 * 3 + 1


# ---- summary and table ---------------------------------------------------------------------


def test_summary_pairs_seeds_and_divides_by_the_churn_free_optimum(hl: ModuleType) -> None:
    c0 = hl.Cell("gpt", "0", "shipped", "default")
    c2 = hl.Cell("gpt", "2", "shipped", "default")
    rows = []
    for seed, (g, rel, reb, opt) in enumerate([(90, 100, 120, 80), (80, 100, 100, 80), (110, 100, 100, 100)]):
        for cell in (c0, c2):
            rows += [_row(hl, cell, seed, "gwtf", g, 100 / g, discarded=0.001 * seed),
                     _row(hl, cell, seed, "swarm-released", rel, 100 / rel),
                     _row(hl, cell, seed, "swarm", reb, 100 / reb)]
        rows.append(_row(hl, c0, seed, hl.OPTIMUM, opt, 100 / opt))
    rows.append(_row(hl, c2, 3, "gwtf", 1.0, 100.0))  # seed 3 lacks SWARM runs: not paired, left out
    rows[0]["finished"] = False
    s0, s2 = hl.summarize(rows, [c0, c2])
    assert s2.cell == c2 and s2.seeds == 3
    red = s2.reduction["swarm-released"]  # (100-90)/100, (100-80)/100, (100-110)/100
    assert (red.median, red.lo, red.hi) == pytest.approx((0.10, -0.10, 0.20))
    red = s2.reduction["swarm"]  # (120-90)/120, 0.2, -0.1
    assert (red.median, red.lo, red.hi) == pytest.approx((0.20, -0.10, 0.25))
    frac = s2.frac_opt["gwtf"]  # opt/g: 80/90, 80/80, 100/110
    assert (frac.median, frac.lo, frac.hi) == pytest.approx((100 / 110, 80 / 90, 1.0))
    assert s2.tput["swarm"].median == pytest.approx(1.0)
    assert s0.unfinished == 1 and s2.unfinished == 0
    assert s2.discarded.hi == pytest.approx(0.002)

    table = hl.markdown_table([s0, s2])
    lines = table.strip().splitlines()
    assert len(lines) == 4
    widths = {line.count("|") for line in lines}
    assert len(widths) == 1  # every row has the header's columns
    assert lines[1].startswith("|---|")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = dict(zip(head, cells, strict=True))
    assert col["churn /h"] == "2" and col["seeds"] == "3"
    assert col["gwtf vs SWARM rel."] == "10.0% [-10.0, 20.0]"
    assert col["gwtf vs SWARM reb."] == "20.0% [-10.0, 25.0]"
    assert col["gwtf / optimum"] == f"{100 / 110:.3f} [{80 / 90:.3f}, 1.000]"
    assert col["gwtf discarded"] == "0.10% [0.00, 0.20]"


def test_missing_optimum_shows_a_dash_and_one_seed_no_range(hl: ModuleType) -> None:
    cell = hl.Cell("llama", "1", "bf16", "uniform")
    rows = [_row(hl, cell, 0, s, 100.0, 1.0) for s in hl.SYSTEMS]
    (s,) = hl.summarize(rows, [cell])
    table = hl.markdown_table([s])
    assert "| - |" in table  # no optimum replay in the rows
    assert "0.0% |" in table and "[" not in table.splitlines()[2]


def test_heatmap_is_a_png(hl: ModuleType, tmp_path: Path) -> None:
    cell = hl.Cell("gpt", "0.33", "compute", "half-slow")
    rows = [_row(hl, cell, 0, "gwtf", 90.0, 1.0), _row(hl, cell, 0, "swarm-released", 100.0, 1.0),
            _row(hl, cell, 0, "swarm", 80.0, 1.0, finished=False)]  # marked "*", still drawn
    out = tmp_path / "h" / "heat.png"
    hl.write_heatmap(hl.summarize(rows, [cell]), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the optimum replay --------------------------------------------------------------------


def test_optimum_router_follows_the_routes(hl: ModuleType) -> None:
    routes = [("d0", "a1", "b2"), ("d0", "c1", "e2"), ("d9", "a1", "e2")]
    link = LinkEstimate(0.01, 1e8)

    def peer(nid: str, stage: int) -> PeerInfo:
        return PeerInfo(id=nid, stage=stage, region="r", compute_s=0.1, capacity=4)

    dh = hl.OptimumRouter(peer("d0", 0), 3, 1000, routes)
    for p in (peer("a1", 1), peer("c1", 1)):
        dh.on_peer_up(p, link, 0.0)
    assert [(s.flow_id, s.next) for s in dh.flow_slots(0.0)] == [(0, "a1"), (1, "c1")]
    # beyond its slots, round-robin over its own routes, tagged with the route's id
    assert [dh.next_hop(NONE, "d0", "d0", (), 0.0) for _ in range(3)] == [("a1", 0), ("c1", 1), ("a1", 0)]
    assert dh.next_hop(NONE, "d0", "d0", {"a1"}, 0.0) == ("c1", 1)

    relay = hl.OptimumRouter(peer("a1", 1), 3, 1000, routes)
    for p in (peer("b2", 2), peer("e2", 2)):
        relay.on_peer_up(p, link, 0.0)
    assert relay.next_hop(0, "d0", "d0", (), 0.0) == ("b2", 0)
    assert relay.next_hop(2, "d9", "d9", (), 0.0) == ("e2", 2)
    assert relay.next_hop(0, "d0", "d0", {"b2"}, 0.0) == ("e2", 0)  # the route's node failed: greedy
    assert relay.flow_slots(0.0) == []
