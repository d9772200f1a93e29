"""benchmarks/routing_quality.py: --seeds lists and ranges, --instances DIR, and the
median / p90 / max columns of its table."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "routing_quality.py"


def _instance(*links: tuple[str, str, float]) -> str:
    """Two stages: data holder d0 (demand 2) and relays r1, r2 of capacity 1, joined by `links`."""
    def node(nid: str, stage: int, cap: int) -> dict[str, object]:
        return {"id": nid, "stage": stage, "role": "relay" if stage else "data-holder", "capacity": cap,
                "compute_s": 0.01}
    return json.dumps({"stages": 2, "activation_bytes": 1000, "latency_unit": "ms",
                       "nodes": [node("d0", 0, 2), node("r1", 1, 1), node("r2", 1, 1)],
                       "links": [{"a": a, "b": b, "latency": ms, "bandwidth": 1e8} for a, b, ms in links]})


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("routing_quality", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("1001-1004", [1001, 1002, 1003, 1004]), ("1,5,9", [1, 5, 9]), ("7", [7]), ("0-2,9,1", [0, 1, 2, 9])],
)
def test_seeds_take_lists_and_ranges(text: str, seeds: list[int]) -> None:
    assert _bench().parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["a", "5-3", "1,,2"])
def test_bad_seeds_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
        _bench().parse_seeds(text)


def test_instances_dir_runs_every_file_per_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "insts"
    folder.mkdir()
    (folder / "a.json").write_text(_instance(("d0", "r1", 10), ("d0", "r2", 20)), encoding="utf-8")
    (folder / "b.json").write_text(_instance(("d0", "r1", 10)), encoding="utf-8")  # r2 unreachable
    (folder / "notes.txt").write_text("not an instance", encoding="utf-8")
    out = tmp_path / "out.json"
    assert _bench().main(["--instances", str(folder), "--seeds", "1,5", "--crash-fraction", "0",
                          "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "(2 files, seeds=1,5)" in table and "median 1.000  p90 1.000  max 1.000" in table
    report = json.loads(out.read_text(encoding="utf-8"))
    assert [r["label"] for r in report["rows"]] == ["a.json seed=1", "a.json seed=5", "b.json seed=1", "b.json seed=5"]
    (summary,) = report["summary"].values()
    assert summary["flow_equal"] == 4
    assert [r["optimal"]["flow"] for r in report["rows"]] == [2, 2, 1, 1]


def test_bad_instances_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text(_instance(("d0", "r1", 10)).replace('"stages": 2', '"stages": 1'),
                                       encoding="utf-8")
    assert _bench().main(["--instances", str(tmp_path)]) == 2
    assert "stages: must be >= 2" in capsys.readouterr().err
    assert _bench().main(["--instances", str(tmp_path / "absent")]) == 2


def test_the_worst_routes_data_holder_is_over_served_only_with_more_flows_than_in_the_optimum() -> None:
    bench = _bench()
    optimum = {"flow_by_data_holder": {"a": 5, "b": 0}, "worst_data_holder": "a"}

    def gwtf(worst: str | None, a: int, b: int) -> dict[str, object]:
        return {"flow_by_data_holder": {"a": a, "b": b}, "worst_data_holder": worst}

    assert bench._worst_over_served(gwtf("b", 1, 4), optimum)  # b's slots cost the most, the optimum gives it none
    assert not bench._worst_over_served(gwtf("a", 5, 0), optimum)
    assert not bench._worst_over_served(gwtf("b", 5, 0), optimum)
    assert not bench._worst_over_served(gwtf(None, 0, 0), optimum)
    rows = [{"optimal": {**optimum, "flow": 5, "max_route_cost_s": 1.0, "lower_bound_max_route_cost_s": 1.0},
             "gwtf": {**gwtf("b", 1, 4), "flow": 5, "max_route_cost_s": 2.0, "converged": True,
                      "converged_at_s": 1.0, "routes_changed_at_s": 1.0, "flow_reached_at_s": 1.0,
                      "messages_per_node": 1.0, "wall_s": 0.1},
             **{k: {"flow": 5, "max_route_cost_s": 3.0} for k in ("swarm", "greedy")}}]
    assert bench.summarize(rows)["gwtf_worst_dh_over_served"] == 1
